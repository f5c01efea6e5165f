"""Examples shipped with megatrain: a reference GPT model and the main training job."""
