"""A process ended in the middle of a background save (tests/test_single.py).

argv: FOLDER MODE. A blocking save of version 1 to FOLDER/ckpt.pt, then a background save
of version 2 (128 MB) to the same path; once its temporary file holds 1 MB:

- ``kill``: the main thread, still training, sends SIGKILL to its own process;
- ``interrupt``: the main thread waits in ``handle.wait()``, and a thread sends SIGINT
  (Ctrl-C) to the process.

Prints "the save finished first" when the write completed before the signal could land.
"""

import os
import signal
import sys
import threading
import time

import torch

import scopedlite as lite

folder, mode = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (CI may ignore SIGINT)
path = os.path.join(folder, "ckpt.pt")
lite.save(path, {"version": 1, "w": torch.zeros(10)})


def partial_size() -> int:
    partial = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".tmp")]
    return os.path.getsize(partial[0]) if partial else 0


def main_thread_waits() -> bool:
    frame = sys._current_frames()[threading.main_thread().ident]
    return frame.f_code.co_filename.endswith("threading.py")  # in Event.wait, under handle.wait()


def interrupt() -> None:
    while not (partial_size() >= 2**20 and main_thread_waits()):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)


weights = torch.full((32_000_000,), 2.0)  # 128 MB: a wide window for the signal on a busy machine
if mode == "interrupt":
    threading.Thread(target=interrupt, daemon=True).start()
handle = lite.save(path, {"version": 2, "w": weights}, blocking=False)
weights.fill_(3.0)  # after the copy: the checkpoint would hold 2.0
if mode == "kill":
    model = torch.nn.Linear(64, 64)
    while partial_size() < 2**20 and not handle.done():
        model(torch.randn(32, 64)).sum().backward()  # training goes on while the file is written
    if not handle.done():
        os.kill(os.getpid(), signal.SIGKILL)
handle.wait()
print("the save finished first")
