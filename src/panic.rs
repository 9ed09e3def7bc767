//! libtorch reports failures (out of memory, a bad shape deep in a kernel) through tch's panicking methods. Compute
//! entry points run inside [`catch_torch`], which turns such a panic into an error carrying libtorch's message, so
//! the caller (a CLI command, a compute thread) decides what to do and nothing unwinds further.
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A panic caught at a compute boundary.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Panicked {
    #[error("libtorch: {0}")]
    Torch(String),
    #[error("internal error (a bug in dflash; please report it): {0}")]
    Bug(String),
}

/// The message of a panic payload.
pub fn payload_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Classifies a panic message: tch's `unwrap` of a libtorch error, or something else.
pub fn classify(message: &str) -> Panicked {
    match message.find("Torch(\"") {
        Some(at) => {
            let rest = &message[at + 7..];
            // tch prints the error with Debug escapes: the first line ends at a literal `\n`.
            let end = rest.find("\\n").or_else(|| rest.rfind("\")")).unwrap_or(rest.len());
            Panicked::Torch(rest[..end].to_string())
        }
        None => Panicked::Bug(message.to_string()),
    }
}

/// Runs `f`, turning a panic into [`Panicked`].
pub fn catch_torch<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| classify(&payload_message(p.as_ref())))
}

/// Whether a panic message is a libtorch error (logged quietly by the panic hook, reported by the caller).
pub fn is_torch_error(message: &str) -> bool {
    message.contains("Torch(\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn libtorch_failures_become_errors_with_the_first_line() {
        let err = catch_torch(|| {
            let a = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
            let b = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
            a.matmul(&b)
        })
        .unwrap_err();
        match err {
            Panicked::Torch(m) => {
                assert!(m.contains("cannot be multiplied"), "{m}");
                assert!(!m.contains("Exception raised from"), "{m}");
            }
            other => panic!("expected a libtorch error, got {other:?}"),
        }
        assert!(matches!(catch_torch(|| panic!("boom")), Err(Panicked::Bug(m)) if m == "boom"));
        assert_eq!(catch_torch(|| 7).unwrap(), 7);
    }
}
