"""lite.WandbLogger (offline) and lite.MLFlowLogger (a local folder store) on 2 real ranks.

argv: folder. Block 1 (ddp, 2 ranks) logs values whose exact floats and steps the test reads
back from W&B's offline run file and MLflow's store; block 2 (one process) reuses the same
loggers and fails, so each starts a new run there and ends it as failed. Writes the runs' ids.
"""

import sys

import torch

import scopedlite as lite
from _common import write

folder = sys.argv[1]
wandb_logger = lite.WandbLogger(project="lite-test", save_dir=folder, mode="offline", config={"lr": 0.1})
mlflow_logger = lite.MLFlowLogger("lite-test", tracking_uri=f"file:{folder}/mlruns", params={"lr": 0.1})
loggers = [wandb_logger, mlflow_logger]
for name in lite.__all__:  # every public module loaded, both loggers built: neither package imported yet
    getattr(lite, name)
imported_early = sorted(m for m in ("wandb", "mlflow") if m in sys.modules)

with lite.launch(accelerator="cpu", strategy="ddp", devices=2, loggers=loggers) as run:
    lite.log("loss", torch.tensor(0.1 + 0.2, dtype=torch.float64))  # step 0
    lite.log("loss", 0.25)  # step 1
    lite.log("loss", 1 / 3, step=10)
    lite.log_dict({"acc": 0.5, "rank": run.global_rank}, step=10)  # rank 0's value, once
    lite.log("acc", 0.75)  # step 11
    lite.log("val_loss", 2.5, step=3)  # below the others' steps: a name's steps are its own
    lite.log("mean", lite.all_reduce(float(run.global_rank), op="mean"), step=12)
first = {"wandb": [wandb_logger.run_id, str(wandb_logger.run_dir)], "mlflow": mlflow_logger.run_id}

try:
    with lite.launch(accelerator="cpu", loggers=loggers):
        lite.log("loss", 7.0)
        raise KeyError("the block fails")
except KeyError:
    pass
second = {"wandb": [wandb_logger.run_id, str(wandb_logger.run_dir)], "mlflow": mlflow_logger.run_id}
write({"first": first, "second": second, "imported_early": imported_early})
