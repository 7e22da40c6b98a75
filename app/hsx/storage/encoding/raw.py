"""raw: `layer_<i>` [T, hidden] of the job's dtype, the rows as the model server gave them.

The shard writer streams these from the staged dumps with no encoder (hsx.storage.shards); a reader's
rows are views of the file's bytes.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hsx.dtypes import DTYPES_BY_CODE, DType
from hsx.storage.encoding.base import Encoding, LayerDecoder, ShardTensors, TensorSpec
from hsx.storage.errors import ShardError


class RawDecoder(LayerDecoder):
    views: ClassVar[bool] = True

    def __init__(self, key: str, tensors: ShardTensors):
        code, shape = tensors.codes.get(key), tensors.shapes.get(key)
        dtype = DTYPES_BY_CODE.get(code or "")
        if dtype is None or not dtype.is_float or shape is None or len(shape) != 2 or shape[0] != tensors.rows:
            raise ShardError(f"{key} is {code} {list(shape or [])}, expected a float dtype [{tensors.rows}, hidden]")
        super().__init__(key, dtype, shape[1], shape[0])
        self.data = tensors.tensor(key)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        return self.data[start * self.row_bytes : stop * self.row_bytes].reshape(stop - start, self.row_bytes)


class Raw(Encoding):
    name = "raw"
    encoded = False
    layout: ClassVar[dict[str, str]] = {"layer_<i>": "dtype [T, hidden_size]"}

    def tensor_names(self, key: str) -> list[str]:
        return [key]

    def specs(self, key: str, rows: int, dtype: DType, hidden_size: int) -> dict[str, TensorSpec]:
        return {key: TensorSpec(dtype.code, (rows, hidden_size))}

    def stored_row_bytes(self, dtype: DType, hidden_size: int) -> int:
        return hidden_size * dtype.itemsize

    def decoder(self, key: str, tensors: ShardTensors) -> LayerDecoder:
        return RawDecoder(key, tensors)

    def metadata(self, dtype: DType, hidden_size: int) -> dict[str, str]:
        return {}
