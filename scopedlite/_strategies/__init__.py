"""Strategies: one class per way of spreading a model over processes, behind one interface.

``base`` defines the interface, ``abilities`` the optional abilities as protocols,
``process_group_strategy`` what the strategies over one torch.distributed group share, and
``registry`` the names ``launch(strategy=...)`` accepts. Strategies import only what lies
below them (core, private, cluster, comm, io, hardware), never the functions users call.
"""
