"""Tasks and datasets: prompts with verifiable answers, their rewards, and the tokenizers.

Importing this package is cheap: transformers and pyarrow are imported only when a Hugging Face
tokenizer is built or a parquet file is read.
"""
from .datasets import Drawn, PromptDataset, Taken
from .hf_tokenizer import HFTokenizer
from .tasks import (TASKS, CopyTask, DataSettings, DigitSumTask, JsonlPromptDataset, Prompt, ReverseTask, Task,
                    Tokenizer, build_task, get_task)
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "TASKS", "CharTokenizer", "CopyTask", "DataSettings", "DigitSumTask", "Drawn",
           "HFTokenizer", "JsonlPromptDataset", "Prompt", "PromptDataset", "ReverseTask", "Taken", "Task", "Tokenizer",
           "build_task", "get_task"]
