"""Strategies: one class per way of spreading a model over processes, behind one interface.

Each strategy is a package named as ``launch(strategy=...)`` names it, its class in
``strategy.py``: ``single``, ``ddp``, ``fsdp``, ``model_parallel``, ``deepspeed``, ``xla``.
The flat modules beside them (and ``deferred``) are what strategies share: ``base`` defines
the interface, ``abilities`` the optional abilities as protocols, ``process_group_strategy``
what the strategies over one torch.distributed group share, ``registry`` the names
``launch(strategy=...)`` accepts, and the machinery of ``join``, of set-up models and of
loading. Strategies import only what lies
below them (core, private, cluster, comm, io, hardware), never the functions users call.
"""
