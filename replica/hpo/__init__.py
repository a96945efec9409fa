"""Distributed hyper-parameter search on Optuna: each trial planned first, then trained on its own ranks."""

try:
    import optuna  # noqa: F401
except ImportError as exc:  # pragma: no cover - the hpo extra is missing
    raise ImportError("replica.hpo searches with Optuna: pip install 'replica[hpo]' (or pip install optuna plotly)") \
        from exc

from replica.hpo.report import write_report
from replica.hpo.search import open_storage, search
from replica.hpo.setup import TrialSetup

__all__ = ["search", "TrialSetup", "write_report", "open_storage"]
