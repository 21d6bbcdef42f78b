"""A model's state on disk: sharded, reshardable checkpoints (`checkpoint`), the tensor layouts
of older checkpoints (`layouts`), and full pretrained weights read into any layout (`pretrained`)."""
