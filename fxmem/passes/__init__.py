"""Graph rewrites, one file per pass family, run in order by the pass manager."""

from fxmem.passes.manager import GraphPass, PassManager, PassRecord, PipelineState

__all__ = ["GraphPass", "PassManager", "PassRecord", "PipelineState"]
