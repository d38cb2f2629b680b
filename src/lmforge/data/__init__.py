"""lmforge.data: downloads, and streaming pipelines from WARC to filtered, deduplicated token shards.

This is the public API. Steps follow datatrove's shape (``run(docs, rank, world_size)``; filters
implement ``filter(doc)``); pipelines are TOML files run by ``lmforge data run``. Heavy
dependencies (fastwarc, resiliparse, fasttext, numpy, ray) are imported inside the functions that
need them, so importing this package is cheap.
"""

from lmforge.data.classifier import classify, train_classifier
from lmforge.data.contamination import ContaminationIndex
from lmforge.data.core import Document, Filter, Mapper, Step, StepStats, run_steps
from lmforge.data.dedup import (
    DedupStats,
    exact_document_deduplication,
    exact_line_deduplication,
    jaccard,
    minhash_deduplication,
)
from lmforge.data.download import DATASETS, download_dataset, download_file
from lmforge.data.extract import extract_text_from_html_bytes
from lmforge.data.langid import identify_language
from lmforge.data.mixing import MixSource, mix_plan, write_mixture
from lmforge.data.pii import mask_emails, mask_ips, mask_phone_numbers, mask_pii
from lmforge.data.pipeline import (
    ClassifierFilter,
    ContaminationFilter,
    GopherFilter,
    HtmlStep,
    LanguageFilter,
    PiiStep,
    PipelineConfig,
    load_pipeline,
    run_pipeline,
)
from lmforge.data.quality import C4Config, GopherConfig, c4_clean, gopher_quality_filter
from lmforge.data.readers import (
    ReadStats,
    read_documents,
    read_jsonl,
    read_parquet,
    read_text,
    read_warc,
    read_wet,
)
from lmforge.data.shards import write_token_shard

__all__ = [
    "DATASETS",
    "C4Config",
    "ClassifierFilter",
    "ContaminationFilter",
    "ContaminationIndex",
    "DedupStats",
    "Document",
    "Filter",
    "GopherConfig",
    "GopherFilter",
    "HtmlStep",
    "LanguageFilter",
    "Mapper",
    "MixSource",
    "PiiStep",
    "PipelineConfig",
    "ReadStats",
    "Step",
    "StepStats",
    "c4_clean",
    "classify",
    "download_dataset",
    "download_file",
    "exact_document_deduplication",
    "exact_line_deduplication",
    "extract_text_from_html_bytes",
    "gopher_quality_filter",
    "identify_language",
    "jaccard",
    "load_pipeline",
    "mask_emails",
    "mask_ips",
    "mask_phone_numbers",
    "mask_pii",
    "minhash_deduplication",
    "mix_plan",
    "read_documents",
    "read_jsonl",
    "read_parquet",
    "read_text",
    "read_warc",
    "read_wet",
    "run_pipeline",
    "run_steps",
    "train_classifier",
    "write_mixture",
    "write_token_shard",
]
