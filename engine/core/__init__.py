"""The engine in a process of its own: typed messages (``messages.py``) and the busy loop that
steps an :class:`~espalier.engine.engine.Engine` between them (``loop.py``)."""
