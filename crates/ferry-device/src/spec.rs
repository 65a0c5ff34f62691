//! Which devices a rank uses: `none`, `cuda`, `emu:K`, or `auto`.

use ferry_base::error::FerryError;
use std::fmt;
use std::str::FromStr;

/// The device selection (`FERRY_DEVICES`, `--devices`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeviceSpec {
    /// CPU workers only.
    #[default]
    None,
    /// The CUDA GPUs visible to this process, shared out among the ranks of the node (local rank
    /// `r` of `L` takes GPUs `g` with `g mod L = r`; when there are fewer GPUs than ranks, GPU
    /// `r mod G`).
    Cuda,
    /// These CUDA GPUs (bit `k` set: ordinal `k` among the visible ones), for this rank alone
    /// whatever the other ranks of the node use: `cuda:0,1`. For jobs whose ranks differ, e.g.
    /// one rank driving every GPU next to CPU-only ranks.
    CudaOrdinals(u64),
    /// `K` emulated GPUs per rank (host memory with a capacity, asynchronous streams).
    Emu(usize),
    /// `cuda` when a CUDA driver and a GPU are present, else `none`.
    Auto,
}

impl FromStr for DeviceSpec {
    type Err = FerryError;

    /// Parses `none`, `cuda`, `cuda:0,1` (ordinals below 64), `auto`, `emu:K` (K ≥ 1).
    fn from_str(s: &str) -> Result<Self, FerryError> {
        let bad = || {
            FerryError::Config(format!(
                "devices {s:?}: expected none, cuda, cuda:0,1 (ordinals below 64), auto or emu:K (K ≥ 1)"
            ))
        };
        match s.trim() {
            "none" | "cpu" => Ok(DeviceSpec::None),
            "cuda" => Ok(DeviceSpec::Cuda),
            "auto" => Ok(DeviceSpec::Auto),
            t if t.starts_with("cuda:") => {
                let mut mask = 0u64;
                for o in t["cuda:".len()..].split(',') {
                    match o.trim().parse::<u32>() {
                        Ok(k) if k < 64 => mask |= 1 << k,
                        _ => return Err(bad()),
                    }
                }
                Ok(DeviceSpec::CudaOrdinals(mask))
            }
            t => match t.strip_prefix("emu:") {
                Some(k) => match k.parse::<usize>() {
                    Ok(k) if k >= 1 => Ok(DeviceSpec::Emu(k)),
                    _ => Err(bad()),
                },
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::None => write!(f, "none"),
            DeviceSpec::Cuda => write!(f, "cuda"),
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Emu(k) => write!(f, "emu:{k}"),
            DeviceSpec::CudaOrdinals(m) => {
                let o: Vec<String> = (0..64).filter(|k| m >> k & 1 == 1).map(|k| k.to_string()).collect();
                write!(f, "cuda:{}", o.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        assert_eq!("emu:2".parse::<DeviceSpec>().unwrap(), DeviceSpec::Emu(2));
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda);
        assert!("emu:0".parse::<DeviceSpec>().is_err());
        assert!("gpu".parse::<DeviceSpec>().is_err());
        assert_eq!(DeviceSpec::Emu(3).to_string(), "emu:3");
        let c = "cuda:0,3".parse::<DeviceSpec>().unwrap();
        assert_eq!(c, DeviceSpec::CudaOrdinals(0b1001));
        assert_eq!(c.to_string(), "cuda:0,3");
        assert!("cuda:64".parse::<DeviceSpec>().is_err());
        assert!("cuda:".parse::<DeviceSpec>().is_err());
    }
}
