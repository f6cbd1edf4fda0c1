from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_BOOL: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_FLOAT64: _ClassVar[DataType]

class RequestClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_CLASS_UNSPECIFIED: _ClassVar[RequestClass]
    REQUEST_CLASS_CRITICAL: _ClassVar[RequestClass]
    REQUEST_CLASS_BULK: _ClassVar[RequestClass]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_BOOL: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_INT8: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_FLOAT64: DataType
REQUEST_CLASS_UNSPECIFIED: RequestClass
REQUEST_CLASS_CRITICAL: RequestClass
REQUEST_CLASS_BULK: RequestClass

class SharedMemoryRef(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "shared_memory")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared_memory: SharedMemoryRef
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("model", "inputs", "request_class", "output_names", "output_shared_memory", "client_id")
    class OutputSharedMemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SharedMemoryRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NAMES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    request_class: RequestClass
    output_names: _containers.RepeatedScalarFieldContainer[str]
    output_shared_memory: _containers.MessageMap[str, SharedMemoryRef]
    client_id: str
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., request_class: _Optional[_Union[RequestClass, str]] = ..., output_names: _Optional[_Iterable[str]] = ..., output_shared_memory: _Optional[_Mapping[str, SharedMemoryRef]] = ..., client_id: _Optional[str] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("model", "outputs", "execution_provider", "queue_ms", "compute_ms", "batch_size", "padded_batch_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PADDED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    execution_provider: str
    queue_ms: float
    compute_ms: float
    batch_size: int
    padded_batch_size: int
    def __init__(self, model: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., execution_provider: _Optional[str] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., padded_batch_size: _Optional[int] = ...) -> None: ...

class ModelMetadataRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("name", "version", "description", "inputs", "outputs", "execution_provider", "available_providers", "max_batch_size", "runtime")
    class RuntimeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    execution_provider: str
    available_providers: _containers.RepeatedScalarFieldContainer[str]
    max_batch_size: int
    runtime: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., execution_provider: _Optional[str] = ..., available_providers: _Optional[_Iterable[str]] = ..., max_batch_size: _Optional[int] = ..., runtime: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...

class SystemSharedMemory(_message.Message):
    __slots__ = ("key", "offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaSharedMemory(_message.Message):
    __slots__ = ("raw_handle", "device_id")
    RAW_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    raw_handle: bytes
    device_id: int
    def __init__(self, raw_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("client_id", "name", "byte_size", "system", "cuda")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    name: str
    byte_size: int
    system: SystemSharedMemory
    cuda: CudaSharedMemory
    def __init__(self, client_id: _Optional[str] = ..., name: _Optional[str] = ..., byte_size: _Optional[int] = ..., system: _Optional[_Union[SystemSharedMemory, _Mapping]] = ..., cuda: _Optional[_Union[CudaSharedMemory, _Mapping]] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: float
    def __init__(self, lease_ttl_ms: _Optional[float] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("client_id", "name")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    name: str
    def __init__(self, client_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class SharedMemoryStatusRequest(_message.Message):
    __slots__ = ("client_id", "name")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    name: str
    def __init__(self, client_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SharedMemoryRegionStatus(_message.Message):
    __slots__ = ("name", "byte_size", "system", "cuda", "in_flight", "expires_in_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    byte_size: int
    system: SystemSharedMemory
    cuda: CudaSharedMemory
    in_flight: int
    expires_in_ms: float
    def __init__(self, name: _Optional[str] = ..., byte_size: _Optional[int] = ..., system: _Optional[_Union[SystemSharedMemory, _Mapping]] = ..., cuda: _Optional[_Union[CudaSharedMemory, _Mapping]] = ..., in_flight: _Optional[int] = ..., expires_in_ms: _Optional[float] = ...) -> None: ...

class SharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions", "lease_ttl_ms")
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[SharedMemoryRegionStatus]
    lease_ttl_ms: float
    def __init__(self, regions: _Optional[_Iterable[_Union[SharedMemoryRegionStatus, _Mapping]]] = ..., lease_ttl_ms: _Optional[float] = ...) -> None: ...
