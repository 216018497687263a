"""``lite.launch``: the scope, one object per role, starting and supervising workers, stack
dumps, stop signals and rank-prefixed output."""
