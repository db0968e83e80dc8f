"""Building blocks shared by every model family: norms, rotary embedding, fused projections."""
