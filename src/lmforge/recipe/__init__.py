"""The recipe: lmforge's stages run as one resumable job, data → tokenizer → pretraining → SFT
→ RL → evaluation → report card (``lmforge recipe run configs/recipes/tiny-cpu.toml``).

This is the public API.
"""

from lmforge.recipe.config import STAGES, RecipeConfig, load_recipe
from lmforge.recipe.runner import run_recipe
from lmforge.recipe.stages import centered_accuracy, core_score, split_documents
from lmforge.recipe.threads import choose_threads, machine_threads

__all__ = [
    "STAGES",
    "RecipeConfig",
    "centered_accuracy",
    "choose_threads",
    "core_score",
    "load_recipe",
    "machine_threads",
    "run_recipe",
    "split_documents",
]
