"""Models and data for the real workloads (ResNet-18, MiniLM + LoRA, SmolLM2 + LoRA)."""
