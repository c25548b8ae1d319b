"""Kimi-Linear-architecture compute core: KDA layers with exact checkpoints, MLA layers
over a paged latent KV pool, MoE feed-forward (DESIGN §9)."""
