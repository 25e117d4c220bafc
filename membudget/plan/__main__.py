from membudget.collector import collect_rarely

from .cli import main

collect_rarely()  # planning on fake tensors allocates millions of short-lived objects (torch is already loaded)
main()
