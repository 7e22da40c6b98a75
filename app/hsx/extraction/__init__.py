"""Extraction: the single writer per dump root claims samples, extracts their hidden states from
the model server, stages the dumps and writes them into shards."""

from hsx.extraction.writer import Writer, writer_engine

__all__ = ["Writer", "writer_engine"]
