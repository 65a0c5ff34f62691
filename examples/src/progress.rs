//! A progress bar on rank 0 while a run is going (indicatif), shown only when stderr is a
//! terminal and not in quiet mode: it polls [`ferry::Runtime::progress`] every 100 ms.

use ferry::Runtime;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Stops and clears the bar when dropped.
pub struct Progress {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    /// Starts a bar labelled `label` on rank 0 of `rt`, unless `quiet` or stderr is not a
    /// terminal (then it does nothing).
    pub fn start(rt: &Arc<Runtime>, label: &str, quiet: bool) -> Progress {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = (!quiet && rt.rank() == 0 && std::io::stderr().is_terminal())
            .then(|| {
                let (rt, stop, label) = (rt.clone(), stop.clone(), label.to_string());
                std::thread::Builder::new()
                    .name("progress".into())
                    .spawn(move || {
                        let bar = indicatif::ProgressBar::new(1);
                        bar.set_style(
                            indicatif::ProgressStyle::with_template(
                                "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} tasks and transfers",
                            )
                            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                        );
                        bar.set_message(label);
                        while !stop.load(Ordering::Relaxed) {
                            let (done, left) = rt.progress();
                            bar.set_length(done + left);
                            bar.set_position(done);
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        bar.finish_and_clear();
                    })
                    .ok()
            })
            .flatten();
        Progress { stop, thread }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
