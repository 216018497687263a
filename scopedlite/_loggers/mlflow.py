"""``lite.MLFlowLogger``: metrics to an MLflow run (``scopedlite[mlflow]``)."""

from __future__ import annotations

import importlib.util
import time
from typing import Any, Mapping

__all__ = ["MLFlowLogger"]


class MLFlowLogger:
    """Log every value to one MLflow run per launch block, through ``MlflowClient``.

    Needs MLflow (``pip install scopedlite[mlflow]``, which installs ``mlflow-skinny``); it is
    checked for when the logger is built, and imported with the run created on the first
    write (on global rank 0 only). Each value is an MLflow metric at its ``lite.log`` step; the
    run ends ``FINISHED``, or ``FAILED`` when the block raised.

    Where the run goes is MLflow's tracking URI: a server (``http://...``), a database
    (``sqlite:///mlflow.db``, which needs the full ``mlflow`` package), or a local folder
    (``file:./mlruns``). MLflow 3 keeps the folder store in maintenance mode and refuses it
    unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set; that refusal is MLflow's, raised at the
    first write.

    Args:
        experiment_name: The experiment, created if missing.
        run_name: The run's name (None: MLflow picks one).
        tracking_uri: Where runs are stored; None for MLflow's default (``MLFLOW_TRACKING_URI``).
        tags: Tags of the run.
        params: Hyperparameters, logged once when the run starts (``log_param``).

    A logger reused by a later launch block starts a new run there (each block's steps count
    from 0 again); ``run_id`` is the latest one's.
    """

    def __init__(
        self,
        experiment_name: str = "scopedlite",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(experiment_name, str) or not experiment_name:
            raise TypeError(f"MLFlowLogger(experiment_name={experiment_name!r}): a non-empty str.")
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError(
                "lite.MLFlowLogger needs MLflow: pip install 'scopedlite[mlflow]' (or pip install "
                "mlflow-skinny), or log with lite.CSVLogger(path) instead."
            )
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self.params = dict(params or {})
        self._client: Any = None
        self._metric: Any = None
        self.run_id: str | None = None

    def _open(self) -> Any:
        # MLflow takes seconds to import: on rank 0's first write
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment_name)
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id, self._metric = run.info.run_id, Metric
        if self.params:
            client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in self.params.items()])
        return client

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._client is None:
            self._client = self._open()
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def finalize(self, status: str) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            client.set_terminated(self.run_id, "FINISHED" if status == "success" else "FAILED")

    def __repr__(self) -> str:
        return f"MLFlowLogger(experiment_name={self.experiment_name!r})"
