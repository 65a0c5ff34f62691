//! Active messages: a handler per tag, and the messages that arrive before their handler.
//!
//! A message for a tag without a handler is kept, in arrival order, until one is registered:
//! ranks register their handlers at their own pace, and a peer that sends first loses nothing.
//! Delivery order per (source, tag) is the send order (MPI's non-overtaking rule on the one
//! communicator every active message over MPI travels on, and between ranks of a node the
//! rings' order, which counts of MPI messages tie to MPI's: `am_rings.rs`), and the held
//! messages of a tag are delivered before any that arrives after them.

use crate::delivery::Delivery;
use crate::error::{EngineError, Result};
use ferry_base::error::Rank;
pub use ferry_comm::AmBuf as AmBytes;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// An active message as its handler receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmMessage {
    /// The rank that sent it.
    pub source: Rank,
    /// Its tag.
    pub tag: u16,
    /// Its payload (at most [`crate::AM_MAX_PAYLOAD`] bytes), read as a `[u8]`: in a buffer of
    /// the engine's active-message pool when longer than [`ferry_comm::AM_COPY_OUT`] bytes, which
    /// goes back to the pool when the message is dropped ([`AmBytes::into_vec`] copies the bytes
    /// out, to keep them for long).
    pub bytes: AmBytes,
}

/// A handler of one tag's active messages. It runs where the engine's callbacks run
/// ([`crate::Completions`]); it must not block waiting for another engine event (on the progress
/// thread that event would never come) and must not call MPI, but it may start engine operations.
pub type Handler = Arc<dyn Fn(AmMessage) + Send + Sync>;

#[derive(Default)]
struct Tags {
    handlers: FxHashMap<u16, Handler>,
    /// Messages whose tag had no handler when they arrived (or that arrived while older ones
    /// of their tag were still held), per tag, oldest first.
    held: FxHashMap<u16, VecDeque<AmMessage>>,
}

/// The handlers of this rank.
#[derive(Default)]
pub(crate) struct Handlers {
    tags: Mutex<Tags>,
}

impl Handlers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tags> {
        self.tags.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `h` for `tag`; returns whether messages are held for it (the caller then has
    /// the progress thread [`Handlers::flush`] them).
    pub(crate) fn register(&self, tag: u16, h: Handler) -> Result<bool> {
        let mut t = self.lock();
        if t.handlers.contains_key(&tag) {
            return Err(EngineError::TagTaken(tag));
        }
        t.handlers.insert(tag, h);
        Ok(t.held.get(&tag).is_some_and(|q| !q.is_empty()))
    }

    pub(crate) fn unregister(&self, tag: u16) -> Result<()> {
        self.lock()
            .handlers
            .remove(&tag)
            .map(|_| ())
            .ok_or(EngineError::UnknownTag(tag))
    }

    /// A message arrived (on the progress thread): delivered, or held.
    pub(crate) fn arrived(&self, m: AmMessage, delivery: &Delivery) {
        if let Some((h, m)) = self.handler_for(m) {
            delivery.deliver(Box::new(move || h(m)));
        }
    }

    /// A message the listener received: its handler runs at once where callbacks run on the
    /// progress loop and none is waiting before it (a pass sooner than [`Handlers::arrived`]),
    /// else it is delivered or held.
    pub(crate) fn received(&self, m: AmMessage, delivery: &Delivery) {
        if let Some((h, m)) = self.handler_for(m) {
            delivery.run_or_deliver(Box::new(move || h(m)));
        }
    }

    /// The handler of `m`'s tag with `m`, or `None` when `m` is held (no handler, or older
    /// messages of its tag held).
    fn handler_for(&self, m: AmMessage) -> Option<(Handler, AmMessage)> {
        let mut t = self.lock();
        let held = t.held.get(&m.tag).is_some_and(|q| !q.is_empty());
        match t.handlers.get(&m.tag) {
            Some(h) if !held => Some((h.clone(), m)),
            _ => {
                t.held.entry(m.tag).or_default().push_back(m);
                None
            }
        }
    }

    /// Delivers the held messages of `tag` while it has a handler (on the progress thread).
    pub(crate) fn flush(&self, tag: u16, delivery: &Delivery) {
        loop {
            let (h, m) = {
                let mut t = self.lock();
                let Some(h) = t.handlers.get(&tag).cloned() else { return };
                let Some(m) = t.held.get_mut(&tag).and_then(|q| q.pop_front()) else {
                    return;
                };
                (h, m)
            };
            delivery.deliver(Box::new(move || h(m)));
        }
    }

    /// Drops every handler (at finalize: a handler may hold a handle on the engine).
    pub(crate) fn clear(&self) {
        self.lock().handlers.clear();
    }

    /// Messages held for want of a handler.
    pub(crate) fn held(&self) -> usize {
        self.lock().held.values().map(|q| q.len()).sum()
    }
}
