"""The reference pipeline's stages: plain functions ``fn(ctx: StageContext) -> None`` (see README)."""
