"""The core: scopes, the run and its placement, precision, nested structures, in-place
module building. Imports nothing else of scopedlite."""
