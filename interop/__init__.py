"""Model interchange: Hugging Face checkpoints in and out (`tessera-convert`)."""
