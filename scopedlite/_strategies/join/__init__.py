"""``lite.join`` over a process group: the session that lets ranks run out of data at
different times (DDP, FSDP2, DeepSpeed ZeRO 1-3, model_parallel).

Three roles, as in torch's ``torch.distributed.algorithms.join``:

- what takes part: the set-up models of the block (``members.py`` answers whether a model is
  in an open block), their optimizers and LR schedulers (``events.py``);
- what a backend does in a round: :class:`~hook.JoinHook` (``hook.py``), the template whose
  defaults ``ddp/join.py``, ``fsdp/join.py`` and ``deepspeed/join.py`` override;
- the loop: :class:`~session.JoinSession` (``session.py``), with the message each rank sends
  at the start of a round and the verdict every rank reads from all of them (``message.py``)
  and our collectives' payloads inside the block (``collectives.py``).
"""
