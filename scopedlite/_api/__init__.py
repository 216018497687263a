"""The functions users call (``lite.setup``, ``lite.join``, ``lite.save``, ...): the front
end, on top of everything. It reaches strategies only through declared abilities."""
