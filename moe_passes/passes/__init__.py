"""The MoE passes: find routing and expert regions in the canonical IR, then rewrite each into one fused call."""
