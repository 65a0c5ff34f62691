//! A completion shared by several parts of one operation.

use crate::error::{FerryError, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Called once with the outcome of the whole operation.
pub type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// Runs `done` once `n` parts have arrived, with the first error among them.
pub struct Join {
    left: AtomicUsize,
    err: Mutex<Option<FerryError>>,
    done: Mutex<Option<Done>>,
}

impl Join {
    /// A join of `n` parts (`n` ≥ 1: with none, `done` never runs).
    pub fn new(n: usize, done: Done) -> Arc<Join> {
        Arc::new(Join {
            left: AtomicUsize::new(n),
            err: Mutex::new(None),
            done: Mutex::new(Some(done)),
        })
    }

    /// One part has ended with `r`; the last to arrive runs `done`.
    pub fn arrive(&self, r: Result<()>) {
        if let Err(e) = r {
            self.err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let err = self.err.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(done) = self.done.lock().unwrap_or_else(|p| p.into_inner()).take() {
                done(err.map_or(Ok(()), Err));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_reports_the_first_error_once() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let j = Join::new(
            3,
            Box::new(move |r| s.lock().unwrap().push(r.map_err(|e| e.to_string()))),
        );
        j.arrive(Ok(()));
        j.arrive(Err(FerryError::Poisoned("first".into())));
        assert!(seen.lock().unwrap().is_empty());
        j.arrive(Err(FerryError::Poisoned("second".into())));
        let v = seen.lock().unwrap();
        assert_eq!(v.len(), 1);
        assert!(v[0].as_ref().unwrap_err().contains("first"));
    }
}
