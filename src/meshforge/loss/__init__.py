"""Training losses: token cross-entropy (plain, chunked, fused with the LM head), the LM loss
formulation a run uses, and multi-token prediction."""
