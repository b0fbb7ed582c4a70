"""`pipec profile`: stage, slice, link and layer costs measured on this machine."""
