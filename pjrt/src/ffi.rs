//! Hand-written declarations for the subset of the PJRT C API (`pjrt_c_api.h`) that xtrain uses.
//!
//! Written against header version 0.81. Every argument struct starts with `struct_size` (set to the
//! size the header defines: offset of the last field plus its size) and `extension_start`; the plugin
//! checks `struct_size`, which is what lets one binary talk to older and newer plugins.
#![allow(non_snake_case, non_camel_case_types, dead_code)]

use std::ffi::{c_char, c_int, c_void};

/// The header version these declarations were written against.
pub const HEADER_MAJOR: i32 = 0;
pub const HEADER_MINOR: i32 = 81;

pub enum PJRT_Error {}
pub enum PJRT_Client {}
pub enum PJRT_Device {}
pub enum PJRT_DeviceDescription {}
pub enum PJRT_Buffer {}
pub enum PJRT_Event {}
pub enum PJRT_Executable {}
pub enum PJRT_LoadedExecutable {}
pub enum PJRT_SerializedExecutable {}
pub enum PJRT_TopologyDescription {}
pub enum PJRT_Memory {}

/// Every API entry takes one pointer to its argument struct and returns an error or null.
pub type ApiFn = Option<unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error>;

/// `PJRT_STRUCT_SIZE(T, last_field)`: the byte size a caller declares for an argument struct.
#[macro_export]
macro_rules! struct_size {
    ($t:ty, $last:ident) => {{
        let probe = std::mem::MaybeUninit::<$t>::uninit();
        let base = probe.as_ptr();
        // SAFETY: only the address of a field is taken, nothing is read.
        let field = unsafe { std::ptr::addr_of!((*base).$last) };
        fn size_of_pointee<T>(_: *const T) -> usize {
            std::mem::size_of::<T>()
        }
        std::mem::offset_of!($t, $last) + size_of_pointee(field)
    }};
}

#[repr(C)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub major_version: c_int,
    pub minor_version: c_int,
}

/// The function table a plugin returns from `GetPjrtApi`, in header order.
#[repr(C)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub pjrt_api_version: PJRT_Api_Version,
    pub Error_Destroy: Option<unsafe extern "C" fn(*mut c_void)>,
    pub Error_Message: Option<unsafe extern "C" fn(*mut c_void)>,
    pub Error_GetCode: ApiFn,
    pub Plugin_Initialize: ApiFn,
    pub Plugin_Attributes: ApiFn,
    pub Event_Destroy: ApiFn,
    pub Event_IsReady: ApiFn,
    pub Event_Error: ApiFn,
    pub Event_Await: ApiFn,
    pub Event_OnReady: ApiFn,
    pub Client_Create: ApiFn,
    pub Client_Destroy: ApiFn,
    pub Client_PlatformName: ApiFn,
    pub Client_ProcessIndex: ApiFn,
    pub Client_PlatformVersion: ApiFn,
    pub Client_Devices: ApiFn,
    pub Client_AddressableDevices: ApiFn,
    pub Client_LookupDevice: ApiFn,
    pub Client_LookupAddressableDevice: ApiFn,
    pub Client_AddressableMemories: ApiFn,
    pub Client_Compile: ApiFn,
    pub Client_DefaultDeviceAssignment: ApiFn,
    pub Client_BufferFromHostBuffer: ApiFn,
    pub DeviceDescription_Id: ApiFn,
    pub DeviceDescription_ProcessIndex: ApiFn,
    pub DeviceDescription_Attributes: ApiFn,
    pub DeviceDescription_Kind: ApiFn,
    pub DeviceDescription_DebugString: ApiFn,
    pub DeviceDescription_ToString: ApiFn,
    pub Device_GetDescription: ApiFn,
    pub Device_IsAddressable: ApiFn,
    pub Device_LocalHardwareId: ApiFn,
    pub Device_AddressableMemories: ApiFn,
    pub Device_DefaultMemory: ApiFn,
    pub Device_MemoryStats: ApiFn,
    pub Memory_Id: ApiFn,
    pub Memory_Kind: ApiFn,
    pub Memory_DebugString: ApiFn,
    pub Memory_ToString: ApiFn,
    pub Memory_AddressableByDevices: ApiFn,
    pub Executable_Destroy: ApiFn,
    pub Executable_Name: ApiFn,
    pub Executable_NumReplicas: ApiFn,
    pub Executable_NumPartitions: ApiFn,
    pub Executable_NumOutputs: ApiFn,
    pub Executable_SizeOfGeneratedCodeInBytes: ApiFn,
    pub Executable_GetCostAnalysis: ApiFn,
    pub Executable_OutputMemoryKinds: ApiFn,
    pub Executable_OptimizedProgram: ApiFn,
    pub Executable_Serialize: ApiFn,
    pub LoadedExecutable_Destroy: ApiFn,
    pub LoadedExecutable_GetExecutable: ApiFn,
    pub LoadedExecutable_AddressableDevices: ApiFn,
    pub LoadedExecutable_Delete: ApiFn,
    pub LoadedExecutable_IsDeleted: ApiFn,
    pub LoadedExecutable_Execute: ApiFn,
    pub Executable_DeserializeAndLoad: ApiFn,
    pub LoadedExecutable_Fingerprint: ApiFn,
    pub Buffer_Destroy: ApiFn,
    pub Buffer_ElementType: ApiFn,
    pub Buffer_Dimensions: ApiFn,
    pub Buffer_UnpaddedDimensions: ApiFn,
    pub Buffer_DynamicDimensionIndices: ApiFn,
    pub Buffer_GetMemoryLayout: ApiFn,
    pub Buffer_OnDeviceSizeInBytes: ApiFn,
    pub Buffer_Device: ApiFn,
    pub Buffer_Memory: ApiFn,
    pub Buffer_Delete: ApiFn,
    pub Buffer_IsDeleted: ApiFn,
    pub Buffer_CopyToDevice: ApiFn,
    pub Buffer_ToHostBuffer: ApiFn,
    pub Buffer_IsOnCpu: ApiFn,
    pub Buffer_ReadyEvent: ApiFn,
    pub Buffer_UnsafePointer: ApiFn,
    pub Buffer_IncreaseExternalReferenceCount: ApiFn,
    pub Buffer_DecreaseExternalReferenceCount: ApiFn,
    pub Buffer_OpaqueDeviceMemoryDataPointer: ApiFn,
    pub CopyToDeviceStream_Destroy: ApiFn,
    pub CopyToDeviceStream_AddChunk: ApiFn,
    pub CopyToDeviceStream_TotalBytes: ApiFn,
    pub CopyToDeviceStream_GranuleSize: ApiFn,
    pub CopyToDeviceStream_CurrentBytes: ApiFn,
    pub TopologyDescription_Create: ApiFn,
    pub TopologyDescription_Destroy: ApiFn,
    pub TopologyDescription_PlatformName: ApiFn,
    pub TopologyDescription_PlatformVersion: ApiFn,
    pub TopologyDescription_GetDeviceDescriptions: ApiFn,
    pub TopologyDescription_Serialize: ApiFn,
    pub TopologyDescription_Attributes: ApiFn,
    pub Compile: ApiFn,
    pub Executable_OutputElementTypes: ApiFn,
    pub Executable_OutputDimensions: ApiFn,
    pub Buffer_CopyToMemory: ApiFn,
    pub Client_CreateViewOfDeviceBuffer: ApiFn,
    pub Executable_Fingerprint: ApiFn,
    pub Client_TopologyDescription: ApiFn,
    pub Executable_GetCompiledMemoryStats: ApiFn,
    pub Memory_Kind_Id: ApiFn,
    pub ExecuteContext_Create: ApiFn,
    pub ExecuteContext_Destroy: ApiFn,
    pub Buffer_CopyRawToHost: ApiFn,
    pub AsyncHostToDeviceTransferManager_Destroy: ApiFn,
    pub AsyncHostToDeviceTransferManager_TransferData: ApiFn,
    pub Client_CreateBuffersForAsyncHostToDevice: ApiFn,
    pub AsyncHostToDeviceTransferManager_RetrieveBuffer: ApiFn,
    pub AsyncHostToDeviceTransferManager_Device: ApiFn,
    pub AsyncHostToDeviceTransferManager_BufferCount: ApiFn,
    pub AsyncHostToDeviceTransferManager_BufferSize: ApiFn,
    pub AsyncHostToDeviceTransferManager_SetBufferError: ApiFn,
    pub AsyncHostToDeviceTransferManager_AddMetadata: ApiFn,
    pub Client_DmaMap: ApiFn,
    pub Client_DmaUnmap: ApiFn,
    pub Client_CreateUninitializedBuffer: ApiFn,
    pub Client_UpdateGlobalProcessInfo: ApiFn,
    pub TopologyDescription_Deserialize: ApiFn,
    pub Client_CreateAliasBuffer: ApiFn,
    pub Client_FulfillAliasBuffer: ApiFn,
    pub LoadedExecutable_GetDeviceAssignment: ApiFn,
}

#[repr(C)]
pub struct PJRT_Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub error: *mut PJRT_Error,
}

#[repr(C)]
pub struct PJRT_Error_Message_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub error: *const PJRT_Error,
    pub message: *const c_char,
    pub message_size: usize,
}

#[repr(C)]
pub struct PJRT_Error_GetCode_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub error: *const PJRT_Error,
    pub code: c_int,
}

#[repr(C)]
pub struct PJRT_Plugin_Initialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
}

#[repr(C)]
pub struct PJRT_Event_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub event: *mut PJRT_Event,
}

pub const NAMED_VALUE_STRING: c_int = 0;
pub const NAMED_VALUE_INT64: c_int = 1;
pub const NAMED_VALUE_INT64_LIST: c_int = 2;
pub const NAMED_VALUE_FLOAT: c_int = 3;
pub const NAMED_VALUE_BOOL: c_int = 4;

#[repr(C)]
pub struct PJRT_NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub name: *const c_char,
    pub name_size: usize,
    pub type_: c_int,
    /// Union of string pointer / int64 / int64 list pointer / float / bool; 8 bytes.
    pub value: u64,
    pub value_size: usize,
}

/// `PJRT_CallbackError`: made by the plugin, called by a callback to make the `PJRT_Error` it
/// returns (`message` is copied).
pub type PJRT_CallbackError = Option<
    unsafe extern "C" fn(code: c_int, message: *const c_char, size: usize) -> *mut PJRT_Error,
>;

/// Frees a value a key-value callback returned.
pub type PJRT_KeyValue_ValueDeleter = Option<unsafe extern "C" fn(value: *mut c_char)>;

#[repr(C)]
pub struct PJRT_KeyValueGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub timeout_in_ms: c_int,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: PJRT_KeyValue_ValueDeleter,
}

#[repr(C)]
pub struct PJRT_KeyValueTryGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: PJRT_KeyValue_ValueDeleter,
}

#[repr(C)]
pub struct PJRT_KeyValuePutCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub value: *const c_char,
    pub value_size: usize,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
}

pub type PJRT_KeyValueGetCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error;
pub type PJRT_KeyValueTryGetCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error;
pub type PJRT_KeyValuePutCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error;

#[repr(C)]
pub struct PJRT_Client_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub create_options: *const PJRT_NamedValue,
    pub num_options: usize,
    pub kv_get_callback: *mut c_void,
    pub kv_get_user_arg: *mut c_void,
    pub kv_put_callback: *mut c_void,
    pub kv_put_user_arg: *mut c_void,
    pub client: *mut PJRT_Client,
    pub kv_try_get_callback: *mut c_void,
    pub kv_try_get_user_arg: *mut c_void,
}

/// Shared shape of `PJRT_Client_Destroy_Args`, `PJRT_Client_PlatformName_Args`,
/// `PJRT_Client_PlatformVersion_Args` and `PJRT_Client_(Addressable)Devices_Args`: a client, then
/// an out pointer and an out length.
#[repr(C)]
pub struct PJRT_Client_PtrLen_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub ptr: *const c_void,
    pub len: usize,
}

#[repr(C)]
pub struct PJRT_Client_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
}

#[repr(C)]
pub struct PJRT_Program {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub code: *mut c_char,
    pub code_size: usize,
    pub format: *const c_char,
    pub format_size: usize,
}

#[repr(C)]
pub struct PJRT_Client_Compile_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub program: *const PJRT_Program,
    pub compile_options: *const c_char,
    pub compile_options_size: usize,
    pub executable: *mut PJRT_LoadedExecutable,
}

pub const HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL: c_int = 0;

#[repr(C)]
pub struct PJRT_Client_BufferFromHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub data: *const c_void,
    pub type_: c_int,
    pub dims: *const i64,
    pub num_dims: usize,
    pub byte_strides: *const i64,
    pub num_byte_strides: usize,
    pub host_buffer_semantics: c_int,
    pub device: *mut PJRT_Device,
    pub memory: *mut c_void,
    pub device_layout: *mut c_void,
    pub done_with_host_buffer: *mut PJRT_Event,
    pub buffer: *mut PJRT_Buffer,
}

#[repr(C)]
pub struct PJRT_DeviceDescription_Id_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device_description: *mut PJRT_DeviceDescription,
    pub id: c_int,
}

#[repr(C)]
pub struct PJRT_DeviceDescription_Str_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device_description: *mut PJRT_DeviceDescription,
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct PJRT_Device_GetDescription_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device: *mut PJRT_Device,
    pub device_description: *mut PJRT_DeviceDescription,
}

#[repr(C)]
pub struct PJRT_Device_MemoryStats_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device: *mut PJRT_Device,
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: i64,
    pub peak_bytes_in_use_is_set: bool,
    pub num_allocs: i64,
    pub num_allocs_is_set: bool,
    pub largest_alloc_size: i64,
    pub largest_alloc_size_is_set: bool,
    pub bytes_limit: i64,
    pub bytes_limit_is_set: bool,
    pub bytes_reserved: i64,
    pub bytes_reserved_is_set: bool,
    pub peak_bytes_reserved: i64,
    pub peak_bytes_reserved_is_set: bool,
    pub bytes_reservable_limit: i64,
    pub bytes_reservable_limit_is_set: bool,
    pub largest_free_block_bytes: i64,
    pub largest_free_block_bytes_is_set: bool,
    pub pool_bytes: i64,
    pub pool_bytes_is_set: bool,
    pub peak_pool_bytes: i64,
    pub peak_pool_bytes_is_set: bool,
}

/// `PJRT_Executable_Destroy_Args`, `PJRT_LoadedExecutable_Destroy_Args` and the like: one handle.
#[repr(C)]
pub struct PJRT_Handle_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub handle: *mut c_void,
}

/// `PJRT_Executable_NumOutputs_Args`, `..._SizeOfGeneratedCodeInBytes_Args`, `PJRT_Buffer_OnDeviceSizeInBytes_Args`:
/// one handle and one word-sized out value.
#[repr(C)]
pub struct PJRT_Handle_Word_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub handle: *mut c_void,
    pub value: i64,
}

/// `PJRT_Executable_Fingerprint_Args` and other handle + (ptr, len) out pairs.
#[repr(C)]
pub struct PJRT_Handle_PtrLen_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub handle: *mut c_void,
    pub ptr: *const c_void,
    pub len: usize,
}

#[repr(C)]
pub struct PJRT_Executable_Serialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *const PJRT_Executable,
    pub serialized_bytes: *const c_char,
    pub serialized_bytes_size: usize,
    pub serialized_executable: *mut PJRT_SerializedExecutable,
    pub serialized_executable_deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
}

#[repr(C)]
pub struct PJRT_LoadedExecutable_GetExecutable_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub loaded_executable: *mut PJRT_LoadedExecutable,
    pub executable: *mut PJRT_Executable,
}

#[repr(C)]
pub struct PJRT_ExecuteOptions {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub send_callbacks: *mut c_void,
    pub recv_callbacks: *mut c_void,
    pub num_send_ops: usize,
    pub num_recv_ops: usize,
    pub launch_id: c_int,
    pub non_donatable_input_indices: *const i64,
    pub num_non_donatable_input_indices: usize,
    pub context: *mut c_void,
    pub call_location: *const c_char,
    pub num_tasks: usize,
    pub task_ids: *mut c_int,
    pub incarnation_ids: *mut i64,
}

#[repr(C)]
pub struct PJRT_LoadedExecutable_Execute_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_LoadedExecutable,
    pub options: *mut PJRT_ExecuteOptions,
    pub argument_lists: *const *const *mut PJRT_Buffer,
    pub num_devices: usize,
    pub num_args: usize,
    pub output_lists: *const *mut *mut PJRT_Buffer,
    pub device_complete_events: *mut *mut PJRT_Event,
    pub execute_device: *mut PJRT_Device,
}

#[repr(C)]
pub struct PJRT_Executable_DeserializeAndLoad_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub serialized_executable: *const c_char,
    pub serialized_executable_size: usize,
    pub loaded_executable: *mut PJRT_LoadedExecutable,
    pub overridden_serialized_compile_options: *const c_char,
    pub overridden_serialized_compile_options_size: usize,
}

#[repr(C)]
pub struct PJRT_Buffer_ElementType_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub type_: c_int,
}

#[repr(C)]
pub struct PJRT_Buffer_Dimensions_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub dims: *const i64,
    pub num_dims: usize,
}

#[repr(C)]
pub struct PJRT_Buffer_IsDeleted_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub is_deleted: bool,
}

#[repr(C)]
pub struct PJRT_Buffer_ToHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub src: *mut PJRT_Buffer,
    pub host_layout: *mut c_void,
    pub dst: *mut c_void,
    pub dst_size: usize,
    pub event: *mut PJRT_Event,
}

#[repr(C)]
pub struct PJRT_Buffer_ReadyEvent_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub event: *mut PJRT_Event,
}

#[repr(C)]
pub struct PJRT_Buffer_Device_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub device: *mut PJRT_Device,
}

#[repr(C)]
pub struct PJRT_Executable_GetCompiledMemoryStats_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_Executable,
    pub generated_code_size_in_bytes: i64,
    pub argument_size_in_bytes: i64,
    pub output_size_in_bytes: i64,
    pub alias_size_in_bytes: i64,
    pub temp_size_in_bytes: i64,
    pub host_generated_code_size_in_bytes: i64,
    pub host_argument_size_in_bytes: i64,
    pub host_output_size_in_bytes: i64,
    pub host_alias_size_in_bytes: i64,
    pub host_temp_size_in_bytes: i64,
    pub peak_memory_in_bytes: i64,
}

#[repr(C)]
pub struct PJRT_Executable_OptimizedProgram_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_Executable,
    pub program: *mut PJRT_Program,
}

#[repr(C)]
pub struct PJRT_DeviceDescription_ProcessIndex_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device_description: *mut PJRT_DeviceDescription,
    pub process_index: c_int,
}

#[repr(C)]
pub struct PJRT_DeviceDescription_Attributes_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device_description: *mut PJRT_DeviceDescription,
    pub num_attributes: usize,
    pub attributes: *const PJRT_NamedValue,
}

#[repr(C)]
pub struct PJRT_TopologyDescription_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub topology_name: *const c_char,
    pub topology_name_size: usize,
    pub create_options: *const PJRT_NamedValue,
    pub num_options: usize,
    pub topology: *mut PJRT_TopologyDescription,
}

/// `PJRT_TopologyDescription_Destroy_Args`.
#[repr(C)]
pub struct PJRT_TopologyDescription_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub topology: *mut PJRT_TopologyDescription,
}

/// `PJRT_TopologyDescription_PlatformName_Args`, `..._PlatformVersion_Args`: a topology, then an
/// out string and its length.
#[repr(C)]
pub struct PJRT_TopologyDescription_Str_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub topology: *mut PJRT_TopologyDescription,
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct PJRT_TopologyDescription_GetDeviceDescriptions_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub topology: *mut PJRT_TopologyDescription,
    pub descriptions: *const *mut PJRT_DeviceDescription,
    pub num_descriptions: usize,
}

#[repr(C)]
pub struct PJRT_TopologyDescription_Attributes_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub topology: *mut PJRT_TopologyDescription,
    pub attributes: *const PJRT_NamedValue,
    pub num_attributes: usize,
}

#[repr(C)]
pub struct PJRT_Compile_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub topology: *const PJRT_TopologyDescription,
    pub program: *const PJRT_Program,
    pub compile_options: *const c_char,
    pub compile_options_size: usize,
    pub client: *mut PJRT_Client,
    pub executable: *mut PJRT_Executable,
}

#[repr(C)]
pub struct PJRT_Executable_GetCostAnalysis_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_Executable,
    pub num_properties: usize,
    pub properties: *const PJRT_NamedValue,
}

/// `PJRT_Device_AddressableMemories_Args`.
#[repr(C)]
pub struct PJRT_Device_AddressableMemories_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device: *mut PJRT_Device,
    pub memories: *const *mut PJRT_Memory,
    pub num_memories: usize,
}

#[repr(C)]
pub struct PJRT_Device_DefaultMemory_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device: *mut PJRT_Device,
    pub memory: *mut PJRT_Memory,
}

#[repr(C)]
pub struct PJRT_Memory_Kind_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub memory: *mut PJRT_Memory,
    pub kind: *const c_char,
    pub kind_size: usize,
}

#[repr(C)]
pub struct PJRT_Buffer_Memory_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub memory: *mut PJRT_Memory,
}
