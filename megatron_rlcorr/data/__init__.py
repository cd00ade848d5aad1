"""Tasks and datasets: prompts with verifiable answers, their rewards, and the char-level tokenizer."""
from .tasks import TASKS, CopyTask, DigitSumTask, JsonlPromptDataset, Prompt, ReverseTask, Task, get_task
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "TASKS", "CharTokenizer", "CopyTask", "DigitSumTask", "JsonlPromptDataset",
           "Prompt", "ReverseTask", "Task", "get_task"]
