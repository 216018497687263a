"""Metrics logging: the ``Logger`` protocol, the per-run record that checks steps and writes on
rank 0 only, and the loggers shipped with scopedlite (CSV built in; TensorBoard, Weights &
Biases and MLflow as extras, each imported on its first write)."""
