"""The GPU machines the check is for may have no TensorFlow: this fake machine has none."""

raise ImportError("no TensorFlow on this fake GPU machine")
