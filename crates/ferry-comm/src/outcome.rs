//! Agreeing on the outcome of a step that each rank takes on its own (opening a file, mapping
//! a peer's pool, waiting for its part of the graph) before a collective that needs all of
//! them: every rank takes part in one allgather whatever happened to it, so a rank that failed
//! never leaves the others blocked in the next collective, and every rank learns who failed.

use super::CommHandle;
use ferry_base::error::Result;

/// A rank's outcome: its payload, or its error's text.
pub type Outcome = std::result::Result<Vec<u8>, String>;

/// The agreed outcome: every rank's payload in rank order, or the first rank that failed and
/// its text.
pub type Agreed = std::result::Result<Vec<Vec<u8>>, (usize, String)>;

/// Encodes `mine` for the allgather: `0` and the payload, or `1` and the text.
pub fn encode(mine: &Outcome) -> Vec<u8> {
    match mine {
        Ok(p) => [&[0u8][..], p].concat(),
        Err(m) => [&[1u8][..], m.as_bytes()].concat(),
    }
}

/// Every rank's payload, in rank order, or the first rank that failed and its text.
pub fn decode(all: Vec<Vec<u8>>) -> Agreed {
    for (r, b) in all.iter().enumerate() {
        if b.first() != Some(&0) {
            return Err((r, String::from_utf8_lossy(b.get(1..).unwrap_or_default()).into_owned()));
        }
    }
    Ok(all.into_iter().map(|mut b| b.split_off(1)).collect())
}

impl CommHandle {
    /// Allgathers this rank's outcome of a step: every rank's payload when the step succeeded
    /// on all of them, else the first rank that failed (this one included) and its text.
    /// Collective.
    ///
    /// # Errors
    /// The allgather's own failure (the outer `Result`).
    pub fn agree(&self, mine: &Outcome) -> Result<Agreed> {
        Ok(decode(self.allgather(encode(mine))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip_and_the_first_failure_wins() {
        let all = vec![encode(&Ok(vec![1, 2])), encode(&Ok(Vec::new()))];
        assert_eq!(decode(all), Ok(vec![vec![1, 2], Vec::new()]));
        let all = vec![
            encode(&Ok(vec![7])),
            encode(&Err("disk full".into())),
            encode(&Err("later".into())),
        ];
        assert_eq!(decode(all), Err((1, "disk full".to_string())));
        // An empty part (never sent by `encode`) counts as a failure without text.
        assert_eq!(decode(vec![Vec::new()]), Err((0, String::new())));
    }
}
