"""Read-only analyses of compiled graphs: what is saved for backward, and why."""

from fxmem.analysis.lora import LoraLinear, find_lora_linears
from fxmem.analysis.roles import ROLE_DESCRIPTIONS, Role
from fxmem.analysis.saved import Analysis, SavedRecord, SavedTensor, analyze

__all__ = ["ROLE_DESCRIPTIONS", "Analysis", "LoraLinear", "Role", "SavedRecord", "SavedTensor", "analyze", "find_lora_linears"]
