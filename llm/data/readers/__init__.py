"""Read and validate alignment data: PRM steps, preference pairs, PPO prompts and SFT conversations.

Every record is checked when it is read. A problem raises :class:`UserError` whose message
names the file, the record number (0-based; for JSON text also the 1-based line it starts on),
the field and the fix. No record is ever dropped silently.

Modules (each docstring gives the details of its part)
    ``records``: the record types, the data kinds (:data:`KINDS`), their formats and fields (:data:`FIELDS`).
    ``sources``: files: JSON list / JSON lines read incrementally, Parquet, Hugging Face dataset
    directories; where a record is, for messages; ``map_keys`` renaming of columns.
    ``reading``: one file's validated records (:func:`iter_records`, :func:`read_records`), argument checks.
    ``mixing``: several files concatenated or interleaved by probabilities (:func:`load_dataset_records`),
    eager or lazy.
    ``common``: the field checks every kind shares. ``conversation``: prompts and conversations from
    PaddleNLP ``src``/``tgt`` turns or TRL message lists.
    ``prm``, ``pairs``, ``prompts``, ``sft``: the schemas of the kinds ``"prm"``, ``"pair"``, ``"prompt"``
    and ``"sft"``; ``problems``: problems to label (``"problem"``); ``orm_eval``: an ORM's dev split, pairs
    and best-of-N candidates (``"orm_eval"``).

Lazy mode
    ``lazy=True`` returns an iterator that reads and validates as it goes, in constant memory.
    It does not shuffle: records come in file order (interleaved when mixing), and
    eager reading returns exactly the same sequence.
"""

from llm.data.readers.mixing import load_dataset_records
from llm.data.readers.reading import iter_records, read_records
from llm.data.readers.records import (
    FIELDS,
    FORMATS,
    KINDS,
    ROLES,
    SUPPORTED_FORMATS,
    Message,
    PairRecord,
    PRMRecord,
    ProblemRecord,
    PromptRecord,
    Record,
    SFTRecord,
)

__all__ = [
    "FIELDS",
    "FORMATS",
    "KINDS",
    "ROLES",
    "SUPPORTED_FORMATS",
    "Message",
    "PRMRecord",
    "PairRecord",
    "ProblemRecord",
    "PromptRecord",
    "Record",
    "SFTRecord",
    "iter_records",
    "load_dataset_records",
    "read_records",
]
