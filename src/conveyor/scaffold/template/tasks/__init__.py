"""The project's stages: plain functions ``fn(ctx: StageContext) -> None``."""
