"""Hydra's entry point to membudget's AC search (`hydra/sweeper=budget_search`, `experiment=budget_search`).

Hydra instantiates only sweepers defined in the `hydra_plugins` package, and imports every module here at each
start of every Hydra app: so this module stays light, and hands the search to `membudget.search`, imported when
a search starts. It also registers the AC sampler's config (`hydra/sweeper/sampler=budget`) when Hydra's Optuna
sweeper is installed (`pip install -e '.[search]'`).
"""

from dataclasses import dataclass
from typing import Any, List

from hydra.plugins.sweeper import Sweeper


class BudgetSearchSweeper(Sweeper):
    """Hydra's Optuna sweeper for AC settings, resumable: see membudget.search.BudgetSearch."""

    def __init__(self, **config: Any) -> None:
        from membudget.search import BudgetSearch

        self.search = BudgetSearch(**config)

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> None:
        self.search.sweep(arguments)


try:
    from hydra.core.config_store import ConfigStore
    # private (hydra_optuna_sweeper has no public API) and imported here, not through membudget.internals, which
    # imports torch: this module is imported at every Hydra start, the torch-free SLURM submitter's included
    from hydra_plugins.hydra_optuna_sweeper.config import SamplerConfig
except ImportError:  # the search extra is not installed: hydra/sweeper=budget_search says so when used
    pass
else:

    @dataclass
    class BudgetSamplerConfig(SamplerConfig):
        """membudget.search.BudgetSampler: each discrete AC setting once, then the memory budget by bisection."""

        _target_: str = "membudget.search.BudgetSampler"
        resolution: float = 1 / 32  # budgets closer than this fraction of the interval are not told apart
        seed: Any = None  # for parameters other than the AC setting's (sampled by TPE)

    ConfigStore.instance().store(group="hydra/sweeper/sampler", name="budget", node=BudgetSamplerConfig,
                                 provider="membudget")
