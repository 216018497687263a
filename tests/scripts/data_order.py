"""What each rank reads, pass by pass, for the loaders a user really writes (tests/test_dataloading.py).

argv: devices. Runs under ddp without seed_everything at first (Python's `random` then differs
per process, as it does for a user who never calls it). Each case is read for two passes
outside lite.join and two inside it; rank 0 writes every rank's record.
"""

import random
import sys
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    SubsetRandomSampler,
)

import scopedlite as lite
from _common import write

N = 11  # uneven on 2 and on 3 ranks
devices = int(sys.argv[1])


class Indexed(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Draws(Dataset):
    """Item i: what the worker's torch, random and numpy generators give next."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return [torch.rand(()).item(), random.random(), float(np.random.rand())]


class PythonShuffle(Sampler):
    """Shuffles with Python's global `random`, unseeded: differs per process unless seeded."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n


class ShuffledBatches(Sampler):
    """A custom batch sampler: batches of 3 in an order drawn with Python's `random`."""

    def __len__(self):
        return (N + 2) // 3

    def __iter__(self):
        batches = [list(range(i, min(i + 3, N))) for i in range(0, N, 3)]
        random.shuffle(batches)
        return iter(batches)


class ByEpoch(Sampler):
    """An order that depends on the epoch only: rotated by it."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([(i + self.epoch) % self.n for i in range(self.n)])

    def __len__(self):
        return self.n


class Endless(Sampler):
    def __iter__(self):
        i = 0
        while True:
            yield i % N
            i += 1


def flat(batch):
    return batch.flatten().tolist() if isinstance(batch, torch.Tensor) else [int(batch)]


def one_pass(loader):
    seen = []
    for batch in loader:
        seen += flat(batch)
    return {"idx": seen, "len": len(loader)}


def read(make, rebuild=False, before=None):
    """Two passes outside join, two inside; `make` builds a fresh DataLoader; `before(p)` runs
    before pass p."""
    loader = lite.setup_dataloader(make())
    passes = []
    for p, inside in enumerate((False, False, True, True)):
        if rebuild:
            loader = lite.setup_dataloader(make())
        if before is not None:
            before(p)
        if inside:
            with lite.join():
                passes.append(dict(one_pass(loader), join=True))
        else:
            passes.append(dict(one_pass(loader), join=False))
    return passes


CASES = {
    "plain": lambda: DataLoader(Indexed(), batch_size=2),
    "shuffle": lambda: DataLoader(Indexed(), batch_size=2, shuffle=True),
    "distributed": lambda: DataLoader(
        Indexed(), batch_size=2, sampler=DistributedSampler(Indexed(), shuffle=True, seed=5)
    ),
    "batch_sampler": lambda: DataLoader(Indexed(), batch_sampler=BatchSampler(PythonShuffle(N), 3, False)),
    "custom_batches": lambda: DataLoader(Indexed(), batch_sampler=ShuffledBatches()),
    "subset": lambda: DataLoader(Indexed(), batch_size=2, sampler=SubsetRandomSampler([i for i in range(N) if i != 4])),
    "by_epoch": lambda: DataLoader(Indexed(), batch_size=None, sampler=ByEpoch(N)),
    "workers": lambda: DataLoader(Indexed(), batch_size=2, shuffle=True, num_workers=2),
}


def payloads_freed_by():
    """Which threads free the tensors handed to torch.distributed: ours (lite's collectives,
    outside and inside join) and, as a control that the count can see gloo's thread, the
    script's own dist.all_reduce of tensors it drops at once. Watched by wrapping the
    functions with ones that note where each tensor given to them is freed."""
    main = threading.get_ident()
    # [in the main thread, in another Python thread (a garbage collection the supervisor's
    # polling set off), in a thread Python did not start (gloo's)]
    freed = {"ours": [0, 0, 0], "raw": [0, 0, 0], "flag": [0, 0, 0]}
    whose = ["ours"]

    def note(key):
        me = threading.get_ident()
        freed[key][0 if me == main else 1 if me in {t.ident for t in threading.enumerate()} else 2] += 1

    def watched(fn):
        def call(*args, **kwargs):
            for arg in args:
                for t in arg if isinstance(arg, list) else [arg]:
                    if isinstance(t, torch.Tensor):
                        weakref.finalize(t, note, whose[0])
            return fn(*args, **kwargs)

        return call

    names = ("all_reduce", "all_gather", "broadcast", "all_gather_single", "all_gather_into_tensor")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, watched(fn))
    try:
        for i in range(60):
            lite.all_reduce(torch.tensor([float(i)]), op="mean")
            lite.all_gather(torch.tensor([i]))
            lite.broadcast({"i": i})
        loader = lite.setup_dataloader(DataLoader(Indexed(), batch_size=1))
        with lite.join():  # uneven: the rounds of join, and our collectives inside it
            for batch in loader:
                lite.all_reduce(batch.float(), op="sum")
        for i in range(40):  # past what the library holds: all of ours above are freed by now
            lite.all_reduce(torch.tensor([float(i)]))
        for _ in range(5):  # which thread lets go last is a race: under load it may be ours 100 times
            whose[0] = "raw"
            for _ in range(100):
                dist.all_reduce(torch.ones(4))
            time.sleep(0.2)  # gloo's threads let go of the last ones
            whose[0] = "flag"  # every rank goes on until each has seen one
            seen = torch.tensor([float(freed["raw"][2] > 0)])
            dist.all_reduce(seen, op=dist.ReduceOp.MIN)
            if seen.item():
                break
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return freed


with lite.launch(strategy="ddp", devices=devices, accelerator="cpu", timeout=60) as run:
    record = {name: read(make) for name, make in CASES.items()}
    shared = Indexed()  # a loader rebuilt every pass over one dataset continues its count
    record["rebuilt"] = read(lambda: DataLoader(shared, batch_size=2, shuffle=True), rebuild=True)
    # torchrun style, resumed at epoch 20: the script sets its own sampler's epoch every pass
    resumed = DistributedSampler(Indexed(), shuffle=True, seed=5)
    record["resumed"] = read(
        lambda: DataLoader(Indexed(), batch_size=2, sampler=resumed), before=lambda p: resumed.set_epoch(20 + p)
    )

    # pytorch/examples' DDP tutorial: one batch peeked at (next(iter(loader))), then
    # sampler.set_epoch(epoch) each epoch, on the user's sampler or on ours (loader.sampler)
    def tutorial(make, sampler_of, early):
        loader = lite.setup_dataloader(make())
        if early:  # set_epoch before the peek too
            sampler_of(loader).set_epoch(0)
        peek = flat(next(iter(loader)))
        passes = []
        for epoch in range(3):
            sampler_of(loader).set_epoch(epoch)
            passes.append(one_pass(loader)["idx"])
        passes.append(one_pass(loader)["idx"])  # no call: the epoch set last holds
        return {"peek": peek, "passes": passes}

    users = DistributedSampler(Indexed(), shuffle=True, seed=5)
    own = lambda: DataLoader(Indexed(), batch_size=2, sampler=users)  # noqa: E731
    fresh = lambda: DataLoader(Indexed(), batch_size=2, sampler=DistributedSampler(Indexed(), shuffle=True, seed=5))  # noqa: E731
    shuffled = lambda: DataLoader(Indexed(), batch_size=2, shuffle=True)  # noqa: E731
    record["tutorial"] = {
        "users": tutorial(own, lambda loader: users, early=False),
        "users_via_loader": tutorial(fresh, lambda loader: loader.sampler, early=True),
        "ours": tutorial(shuffled, lambda loader: loader.sampler, early=False),
        "ours_early": tutorial(shuffled, lambda loader: loader.sampler, early=True),
    }

    try:
        lite.setup_dataloader(DataLoader(Indexed(), sampler=Endless()))
        record["endless"] = "no error"
    except TypeError as e:
        record["endless"] = str(e)

    lite.seed_everything(7)  # the same seed on every rank: worker draws must still differ per rank
    draws = lite.setup_dataloader(DataLoader(Draws(), batch_size=None, num_workers=2))
    record["draws"] = [[list(map(float, d)) for d in draws] for _ in range(2)]

    lite.seed_everything(100 + run.global_rank)  # ranks seeded differently: rank 0's seed wins
    record["reseeded"] = read(CASES["shuffle"])[:1]

    record["freed_by"] = payloads_freed_by()

    everyone = [lite.broadcast(record, src=r) for r in range(run.world_size)]
    if run.global_rank == 0:
        write(everyone)
