//! Running a case with its panic caught: a panic becomes the violation `panic`, with its message
//! and place (recorded by a hook that prints nothing, so a case that panics is reported once,
//! minimized, rather than on every run).

use crate::targets::{Target, Violation};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs one case; a panic becomes the violation `panic`.
pub fn run_case<T: Target>(case: &T::Case) -> Result<u64, Violation> {
    match catch_unwind(AssertUnwindSafe(|| T::check(case))) {
        Ok(r) => r,
        Err(_) => Err(Violation::new(
            "panic",
            LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .unwrap_or_default(),
        )),
    }
}

thread_local! {
    /// The message and place of this thread's last panic.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

pub type PanicHook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static>;

/// Records panics instead of printing them (a case that panics is reported once, minimized);
/// returns the previous hook, to put back.
pub fn quiet_panics() -> PanicHook {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let place = info
            .location()
            .map_or_else(String::new, |l| format!("{}:{}", l.file(), l.line()));
        LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{msg} at {place}")));
    }));
    previous
}
