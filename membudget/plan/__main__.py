from membudget.collector import collect_rarely

collect_rarely()  # before torch loads: planning on fake tensors allocates millions of short-lived objects

from .cli import main  # noqa: E402

main()
