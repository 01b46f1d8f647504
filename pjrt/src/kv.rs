//! A key-value store handed to `PJRT_Client_Create`, through which the GPU plugins of a run's
//! processes exchange their topology and NCCL/RCCL ids (at client creation, and at the first run
//! of each collective: the store must outlive the client, which [`crate::Client`] sees to).
//!
//! The plugin calls three C callbacks: get (blocking, with a timeout), try_get and put. All three
//! are passed: the XLA GPU client uses the store only when try_get is set too. Each callback
//! turns a failure into a `PJRT_Error` through the plugin's own `callback_error` function, with
//! the code the plugin expects (`DEADLINE_EXCEEDED` for a get that timed out, `NOT_FOUND` for a
//! try_get of a missing key), and values go back in `malloc`ed memory the plugin frees with the
//! deleter given beside them.

use crate::ffi::*;
use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

/// The PJRT error codes a store's callbacks return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCode {
    DeadlineExceeded = 4,
    NotFound = 5,
    Internal = 13,
    Unavailable = 14,
}

/// A failed store operation, as the plugin will see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvError {
    pub code: KvCode,
    pub message: String,
}

/// What a store shared by the processes of a run must do. Called from the plugin's threads,
/// several at once.
pub trait KeyValueStore: Send + Sync {
    /// The value of `key`, waiting up to `timeout` for it ([`KvCode::DeadlineExceeded`] after).
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, KvError>;
    /// The value of `key` if it is there, without waiting.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, KvError>;
    fn put(&self, key: &str, value: &[u8]) -> Result<(), KvError>;
}

/// The store as the callbacks' `user_arg` points at it: boxed, so that its address stays put
/// for as long as the client lives.
pub(crate) type Held = Box<std::sync::Arc<dyn KeyValueStore>>;

pub(crate) fn user_arg(held: &Held) -> *mut c_void {
    &**held as *const std::sync::Arc<dyn KeyValueStore> as *mut c_void
}

unsafe fn store<'a>(user_arg: *mut c_void) -> &'a dyn KeyValueStore {
    &**(user_arg as *const std::sync::Arc<dyn KeyValueStore>)
}

unsafe fn key(ptr: *const c_char, len: usize) -> String {
    crate::str_from(ptr, len)
}

unsafe extern "C" fn free_value(value: *mut c_char) {
    libc::free(value as *mut c_void);
}

/// Copy `bytes` into memory the plugin frees with [`free_value`].
fn malloc_copy(bytes: &[u8]) -> *mut c_char {
    // SAFETY: at least one byte is asked for, and `len` bytes are copied into it.
    unsafe {
        let p = libc::malloc(bytes.len().max(1)) as *mut u8;
        if !p.is_null() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
        }
        p as *mut c_char
    }
}

unsafe fn error(callback_error: *mut PJRT_CallbackError, e: &KvError) -> *mut PJRT_Error {
    match callback_error.as_ref().and_then(|f| *f) {
        Some(make) => make(
            e.code as c_int,
            e.message.as_ptr() as *const c_char,
            e.message.len(),
        ),
        // No way to say what failed: the plugin gets no error and no value, as for an empty one.
        None => std::ptr::null_mut(),
    }
}

/// Run `f`, turning a panic into an internal error (no unwinding into the plugin).
fn guarded<T>(f: impl FnOnce() -> Result<T, KvError>) -> Result<T, KvError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(KvError {
            code: KvCode::Internal,
            message: "the key-value store panicked".into(),
        })
    })
}

/// `PJRT_KeyValueGetCallback`.
///
/// # Safety
/// `args` points to a valid argument struct whose `user_arg` came from [`user_arg`] on a store
/// that is still alive (the plugin passes back what `PJRT_Client_Create` was given).
pub unsafe extern "C" fn kv_get(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error {
    let a = &mut *args;
    let k = key(a.key, a.key_size);
    let timeout = Duration::from_millis(a.timeout_in_ms.max(0) as u64);
    let s = store(a.user_arg);
    match guarded(|| s.get(&k, timeout)) {
        Ok(v) => {
            a.value = malloc_copy(&v);
            a.value_size = v.len();
            a.value_deleter_callback = Some(free_value);
            std::ptr::null_mut()
        }
        Err(e) => error(a.callback_error, &e),
    }
}

/// `PJRT_KeyValueTryGetCallback`.
///
/// # Safety
/// `args` points to a valid argument struct whose `user_arg` came from [`user_arg`] on a store
/// that is still alive (the plugin passes back what `PJRT_Client_Create` was given).
pub unsafe extern "C" fn kv_try_get(
    args: *mut PJRT_KeyValueTryGetCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    let k = key(a.key, a.key_size);
    let s = store(a.user_arg);
    match guarded(|| s.try_get(&k)) {
        Ok(Some(v)) => {
            a.value = malloc_copy(&v);
            a.value_size = v.len();
            a.value_deleter_callback = Some(free_value);
            std::ptr::null_mut()
        }
        Ok(None) => error(
            a.callback_error,
            &KvError {
                code: KvCode::NotFound,
                message: format!("key {k:?} not found"),
            },
        ),
        Err(e) => error(a.callback_error, &e),
    }
}

/// `PJRT_KeyValuePutCallback`.
///
/// # Safety
/// `args` points to a valid argument struct whose `user_arg` came from [`user_arg`] on a store
/// that is still alive (the plugin passes back what `PJRT_Client_Create` was given).
pub unsafe extern "C" fn kv_put(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error {
    let a = &mut *args;
    let k = key(a.key, a.key_size);
    let value: &[u8] = if a.value.is_null() {
        &[]
    } else {
        std::slice::from_raw_parts(a.value as *const u8, a.value_size)
    };
    let s = store(a.user_arg);
    match guarded(|| s.put(&k, value)) {
        Ok(()) => std::ptr::null_mut(),
        Err(e) => error(a.callback_error, &e),
    }
}

#[cfg(test)]
mod tests {
    //! The callbacks called as a plugin calls them: argument structs filled in C's way, a
    //! `callback_error` that records what it was asked to make, values freed with the deleter
    //! handed back.
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    #[derive(Default)]
    struct Map(Mutex<HashMap<String, Vec<u8>>>);

    impl KeyValueStore for Map {
        fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, KvError> {
            self.0.lock().unwrap().get(key).cloned().ok_or(KvError {
                code: KvCode::DeadlineExceeded,
                message: format!("no {key} within {timeout:?}"),
            })
        }
        fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, KvError> {
            Ok(self.0.lock().unwrap().get(key).cloned())
        }
        fn put(&self, key: &str, value: &[u8]) -> Result<(), KvError> {
            self.0.lock().unwrap().insert(key.into(), value.to_vec());
            Ok(())
        }
    }

    thread_local! {
        static MADE: std::cell::RefCell<Vec<(c_int, String)>> = Default::default();
    }

    /// Stands in for the plugin's error maker: records the code and message, returns a
    /// recognisable non-null pointer.
    unsafe extern "C" fn make_error(code: c_int, m: *const c_char, n: usize) -> *mut PJRT_Error {
        let message = crate::str_from(m, n);
        MADE.with(|v| v.borrow_mut().push((code, message)));
        8 as *mut PJRT_Error
    }

    fn made() -> Vec<(c_int, String)> {
        MADE.with(|v| std::mem::take(&mut *v.borrow_mut()))
    }

    fn held() -> Held {
        Box::new(Arc::new(Map::default()))
    }

    unsafe fn put(h: &Held, k: &str, v: &[u8], mut maker: PJRT_CallbackError) -> *mut PJRT_Error {
        let mut a: PJRT_KeyValuePutCallback_Args = std::mem::zeroed();
        a.struct_size = crate::struct_size!(PJRT_KeyValuePutCallback_Args, user_arg);
        a.key = k.as_ptr() as *const c_char;
        a.key_size = k.len();
        a.value = v.as_ptr() as *const c_char;
        a.value_size = v.len();
        a.callback_error = &mut maker;
        a.user_arg = user_arg(h);
        kv_put(&mut a)
    }

    #[test]
    fn put_then_get_and_try_get_return_the_bytes_with_a_deleter() {
        let h = held();
        let mut maker: PJRT_CallbackError = Some(make_error);
        let get_size = crate::struct_size!(PJRT_KeyValueGetCallback_Args, value_deleter_callback);
        let try_size =
            crate::struct_size!(PJRT_KeyValueTryGetCallback_Args, value_deleter_callback);
        unsafe {
            assert!(put(&h, "nccl/id", &[0, 7, 0, 255], maker).is_null());
            let mut a: PJRT_KeyValueGetCallback_Args = std::mem::zeroed();
            a.struct_size = get_size;
            a.key = b"nccl/id".as_ptr() as *const c_char;
            a.key_size = 7;
            a.timeout_in_ms = 1000;
            a.callback_error = &mut maker;
            a.user_arg = user_arg(&h);
            assert!(kv_get(&mut a).is_null());
            let got = std::slice::from_raw_parts(a.value as *const u8, a.value_size).to_vec();
            assert_eq!(got, [0, 7, 0, 255]);
            (a.value_deleter_callback.unwrap())(a.value);

            let mut t: PJRT_KeyValueTryGetCallback_Args = std::mem::zeroed();
            t.struct_size = try_size;
            t.key = b"nccl/id".as_ptr() as *const c_char;
            t.key_size = 7;
            t.callback_error = &mut maker;
            t.user_arg = user_arg(&h);
            assert!(kv_try_get(&mut t).is_null());
            assert_eq!(t.value_size, 4);
            (t.value_deleter_callback.unwrap())(t.value);
        }
        assert!(made().is_empty());
    }

    #[test]
    fn a_missing_key_is_deadline_exceeded_for_get_and_not_found_for_try_get() {
        let h = held();
        let mut maker: PJRT_CallbackError = Some(make_error);
        unsafe {
            let mut a: PJRT_KeyValueGetCallback_Args = std::mem::zeroed();
            a.key = b"absent".as_ptr() as *const c_char;
            a.key_size = 6;
            a.timeout_in_ms = 5;
            a.callback_error = &mut maker;
            a.user_arg = user_arg(&h);
            assert_eq!(kv_get(&mut a), 8 as *mut PJRT_Error);
            assert!(a.value.is_null());
            let mut t: PJRT_KeyValueTryGetCallback_Args = std::mem::zeroed();
            t.key = b"absent".as_ptr() as *const c_char;
            t.key_size = 6;
            t.callback_error = &mut maker;
            t.user_arg = user_arg(&h);
            assert_eq!(kv_try_get(&mut t), 8 as *mut PJRT_Error);
        }
        let m = made();
        assert_eq!(m[0].0, KvCode::DeadlineExceeded as c_int);
        assert!(m[0].1.contains("absent") && m[0].1.contains("5ms"), "{m:?}");
        assert_eq!(m[1].0, KvCode::NotFound as c_int);
        assert!(m[1].1.contains("absent"));
    }

    #[test]
    fn an_empty_value_round_trips() {
        let h = held();
        let maker: PJRT_CallbackError = Some(make_error);
        unsafe {
            assert!(put(&h, "empty", &[], maker).is_null());
        }
        assert_eq!(h.try_get("empty").unwrap(), Some(vec![]));
    }
}
