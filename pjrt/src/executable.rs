//! A compiled, loaded program: checking its arguments and running it on its devices.

use crate::ffi::*;
use crate::{
    Buffer, ClientInner, ElementType, Error, Event, MemoryStats, Plugin, Result, UnloadedExecutable,
};
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Arc;

/// A compiled, loaded program.
pub struct Executable {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut PJRT_LoadedExecutable,
    /// Per-device argument types and dims, checked before each execute when known. Plugins do
    /// not all check them (the CPU plugin runs a [6] buffer where [3,2] was compiled).
    pub(crate) inputs: Option<Vec<(ElementType, Vec<i64>)>>,
}

unsafe impl Send for Executable {}
unsafe impl Sync for Executable {}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a = args!(
            PJRT_Handle_Args,
            handle {
                handle: self.raw as *mut c_void
            }
        );
        let _ = (|| call!(&self.client.plugin, LoadedExecutable_Destroy, &mut a))();
    }
}

impl Executable {
    fn p(&self) -> &Plugin {
        &self.client.plugin
    }

    /// The unloaded executable behind this one (a new handle, destroyed when dropped): its
    /// memory figures, cost analysis, optimized program and serialized form.
    pub fn unloaded(&self) -> Result<UnloadedExecutable> {
        let mut a = args!(
            PJRT_LoadedExecutable_GetExecutable_Args,
            executable {
                loaded_executable: self.raw,
            }
        );
        call!(self.p(), LoadedExecutable_GetExecutable, &mut a)?;
        Ok(UnloadedExecutable::from_raw(
            self.client.plugin.clone(),
            a.executable,
        ))
    }

    /// Declare the per-device argument types and dims; [`Executable::execute`] then rejects
    /// arguments that do not match, naming the argument.
    pub fn expect_inputs(&mut self, inputs: Vec<(ElementType, Vec<i64>)>) {
        self.inputs = Some(inputs);
    }

    fn check_inputs(&self, args: &[Vec<&Buffer>]) -> Result<()> {
        let Some(expected) = &self.inputs else {
            return Ok(());
        };
        for (d, list) in args.iter().enumerate() {
            if list.len() != expected.len() {
                return Err(Error::Invalid(format!(
                    "execute: the program takes {} arguments, device {d} was given {}",
                    expected.len(),
                    list.len()
                )));
            }
            for (i, (buf, (ty, dims))) in list.iter().zip(expected).enumerate() {
                let (got_ty, got_dims) = (buf.element_type()?, buf.dims()?);
                if got_ty != *ty || got_dims != *dims {
                    return Err(Error::Invalid(format!(
                        "execute: argument {i} on device {d} should be {ty:?}{dims:?} but is {got_ty:?}{got_dims:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Number of outputs per device.
    pub fn num_outputs(&self) -> Result<usize> {
        self.unloaded()?.num_outputs()
    }

    /// XLA's memory figures for one device of this executable.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        self.unloaded()?.memory_stats()
    }

    /// The plugin's serialized form, loadable with [`Client::deserialize`] by the same plugin build.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        self.unloaded()?.serialize()
    }

    /// Run on every device the program was compiled for. `args[d]` are device d's arguments, in
    /// the program's argument order. Returns each device's outputs. Donated arguments are deleted.
    pub fn execute(&self, args: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        let num_devices = args.len();
        if num_devices == 0 {
            return Err(Error::Invalid("execute needs at least one device".into()));
        }
        let num_args = args[0].len();
        if let Some((d, list)) = args.iter().enumerate().find(|(_, l)| l.len() != num_args) {
            return Err(Error::Invalid(format!(
                "execute: device 0 has {num_args} arguments but device {d} has {}",
                list.len()
            )));
        }
        self.check_inputs(args)?;
        let num_outputs = self.num_outputs()?;
        let arg_ptrs: Vec<Vec<*mut PJRT_Buffer>> = args
            .iter()
            .map(|l| l.iter().map(|b| b.raw).collect())
            .collect();
        let arg_lists: Vec<*const *mut PJRT_Buffer> = arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut out_ptrs: Vec<Vec<*mut PJRT_Buffer>> = (0..num_devices)
            .map(|_| vec![null_mut(); num_outputs])
            .collect();
        let out_lists: Vec<*mut *mut PJRT_Buffer> =
            out_ptrs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: Vec<*mut PJRT_Event> = vec![null_mut(); num_devices];
        let mut options = args!(PJRT_ExecuteOptions, incarnation_ids {});
        let mut a = args!(
            PJRT_LoadedExecutable_Execute_Args,
            execute_device {
                executable: self.raw,
                options: &mut options,
                argument_lists: arg_lists.as_ptr(),
                num_devices: num_devices,
                num_args: num_args,
                output_lists: out_lists.as_ptr(),
                device_complete_events: events.as_mut_ptr(),
            }
        );
        call!(self.p(), LoadedExecutable_Execute, &mut a)?;
        // Own the outputs first, so that they are destroyed even if an event reports an error.
        let outputs: Vec<Vec<Buffer>> = out_ptrs
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .map(|raw| Buffer {
                        client: self.client.clone(),
                        raw,
                        host: None,
                    })
                    .collect()
            })
            .collect();
        let mut first_err = None;
        for e in events {
            if !e.is_null() {
                if let Err(err) = Event::new(self.client.clone(), e).wait() {
                    first_err.get_or_insert(err);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(outputs),
        }
    }
}
