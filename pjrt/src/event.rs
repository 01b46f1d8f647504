//! Completion events of asynchronous work (copies, executions).

use crate::ffi::*;
use crate::{ClientInner, Result};
use std::sync::Arc;

/// A completion event; waiting returns the error of the work it tracks.
pub(crate) struct Event {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Event,
}

impl Event {
    pub(crate) fn new(client: Arc<ClientInner>, raw: *mut PJRT_Event) -> Self {
        Event { client, raw }
    }

    pub(crate) fn wait(self) -> Result<()> {
        let mut a = args!(PJRT_Event_Args, event { event: self.raw });
        call!(&self.client.plugin, Event_Await, &mut a)
    }

    /// Whether the work is done (without waiting).
    pub(crate) fn is_ready(&self) -> Result<bool> {
        let mut a = args!(PJRT_Event_IsReady_Args, is_ready { event: self.raw });
        call!(&self.client.plugin, Event_IsReady, &mut a)?;
        Ok(a.is_ready)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let mut a = args!(PJRT_Event_Args, event { event: self.raw });
        let _ = (|| call!(&self.client.plugin, Event_Destroy, &mut a))();
    }
}
