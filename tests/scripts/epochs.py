"""Each set-up loader counts its own passes, and every rank's lines arrive whole (tests/test_epochs.py).

Two launch blocks in one process: 2 ranks (the script re-executed), then 3 ranks (forked, as a
later block must be). Both run the same body over one module-level training set, so a count
carried from the first block into the second would show. Rank 0 writes every rank's record of
both blocks. Rank 0 alone peeks at the training loader (``next(iter(loader))``) before the
epoch loop: every rank must still read the same epochs. Every rank also prints LINES lines at
the same moment (the test runs this with PYTHONUNBUFFERED=1, where print writes the text and
the newline separately).
"""

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import scopedlite as lite
from _common import write

SEED, LINES = 11, 300


class Rows(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class EpochAware(Sampler):
    """A custom sampler whose order depends on the epoch it is given: rotated by it."""

    def __init__(self, n):
        self.n, self.epoch, self.given = n, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.given.append(epoch)

    def __iter__(self):
        return iter([(i + self.epoch) % self.n for i in range(self.n)])

    def __len__(self):
        return self.n


TRAIN = Rows(13)  # shared by both blocks


def flat(loader):
    return [
        int(i) for batch in loader for i in (batch.flatten().tolist() if isinstance(batch, torch.Tensor) else [batch])
    ]


def body(run):
    lite.seed_everything(SEED)
    val_set = Rows(7)
    train = lite.setup_dataloader(DataLoader(TRAIN, batch_size=2, shuffle=True))
    val = lite.setup_dataloader(
        DataLoader(val_set, batch_size=3, sampler=DistributedSampler(val_set, shuffle=True, seed=3))
    )
    record = {"train": [], "val": []}
    if run.global_rank == 0:  # rank 0 alone peeks at a batch, as scripts do: not a pass (its
        next(iter(train))  # epochs would run one ahead of the others', losing and repeating samples)
    for _ in range(3):  # train and validation in turn, as a training script does
        record["train"].append(flat(train))
        record["val"].append(flat(val))

    # set up after other loaders' passes: each starts at epoch 0
    late_set = Rows(9)
    late = lite.setup_dataloader(
        DataLoader(late_set, batch_size=2, sampler=DistributedSampler(late_set, shuffle=True, seed=1))
    )
    aware = EpochAware(6)
    aware_loader = lite.setup_dataloader(DataLoader(Rows(6), batch_size=None, sampler=aware))
    record["late"] = [flat(late), flat(late)]
    record["aware"] = [flat(aware_loader), flat(aware_loader)]
    record["aware_epochs"] = aware.given

    # rebuilt over the training set: continues its count (3, 4); a re-seed starts it afresh
    record["rebuilt"] = [flat(lite.setup_dataloader(DataLoader(TRAIN, batch_size=2, shuffle=True))) for _ in range(2)]
    lite.seed_everything(SEED)
    record["rebuilt"].append(flat(lite.setup_dataloader(DataLoader(TRAIN, batch_size=2, shuffle=True))))

    lite.barrier()
    for i in range(LINES):  # several writes per line, as print(a, b, ...) makes them
        print("line", run.global_rank, i, "x" * (i * 37 % 200), "end")
    lite.barrier()
    return [lite.broadcast(record, src=r) for r in range(run.world_size)]


blocks = []
for devices in (2, 3):
    with lite.launch(strategy="ddp", devices=devices, accelerator="cpu", timeout=60) as run:
        everyone = body(run)
    blocks.append(everyone)
write(blocks)
