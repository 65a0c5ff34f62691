//! The crate's error type and the shared shape-checking helpers.

/// Every failure a kernel in this crate can report.
///
/// Kernels never panic on bad input passed through the public API: wrong
/// slice lengths, out-of-range tile positions, malformed files and invalid
/// parameters all come back as one of these variants.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A slice does not have the length implied by the dimensions passed
    /// alongside it.
    #[error("shape mismatch for `{what}`: expected {expected} elements, got {got}")]
    Shape {
        /// Name of the offending argument (e.g. `"a"`, `"north"`).
        what: &'static str,
        /// Length implied by the dimensions.
        expected: usize,
        /// Length actually passed.
        got: usize,
    },
    /// A Cholesky factorization met a non-positive (or NaN) pivot, or a
    /// Cholesky factor has a non-positive diagonal entry.
    #[error("matrix is not positive definite: non-positive pivot in column {column}")]
    NotPositiveDefinite {
        /// Zero-based column (within the tile or matrix) of the first bad pivot.
        column: usize,
    },
    /// Reading a file failed (the cause is said in the message, not also the `source`: reports
    /// that print the chain, `{:#}`, said it twice).
    #[error("I/O error: {0}")]
    Io(std::io::Error),
    /// A line of an input file could not be parsed.
    #[error("parse error on line {line}: {msg}")]
    Parse {
        /// One-based line number in the file (the header is line 1).
        line: usize,
        /// What was wrong with the line.
        msg: String,
    },
    /// An argument is out of its valid range (dimensions that overflow,
    /// tiles outside the matrix, bad parameters, unknown names, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl From<std::io::Error> for KernelError {
    fn from(e: std::io::Error) -> Self {
        KernelError::Io(e)
    }
}

/// `rows * cols`, or `InvalidArgument` if the product overflows `usize`.
pub(crate) fn elems(rows: usize, cols: usize) -> Result<usize, KernelError> {
    rows.checked_mul(cols)
        .ok_or_else(|| KernelError::InvalidArgument(format!("dimensions {rows} x {cols} overflow usize")))
}

/// `Ok(())` if `got == expected`, else `KernelError::Shape`.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::Shape { what, expected, got })
    }
}

/// Checks that the block `[start, start + len)` lies inside `[0, total)`.
pub(crate) fn check_range(what: &str, start: usize, len: usize, total: usize) -> Result<(), KernelError> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(KernelError::InvalidArgument(format!(
            "{what} range {start}..{start}+{len} exceeds the dimension {total}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An I/O error says its cause in the message and has no `source` that would repeat it.
    #[test]
    fn io_errors_say_their_cause_once() {
        let e = KernelError::from(std::io::Error::new(std::io::ErrorKind::NotFound, "gone"));
        assert_eq!(e.to_string(), "I/O error: gone");
        assert!(std::error::Error::source(&e).is_none());
    }
}
