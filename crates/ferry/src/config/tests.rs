use super::*;

/// Every variable is declared once, in [`VARIABLES`] with its parser, and documented once: the
/// table of `docs/configuration.md` names the same set, and each entry parses its own value.
#[test]
fn every_variable_is_parsed_listed_and_documented() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md"))
        .expect("docs/configuration.md");
    let documented: std::collections::BTreeSet<&str> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("FERRY_"))
        .collect();
    let listed: std::collections::BTreeSet<&str> = VARIABLES.iter().map(|x| x.name).collect();
    assert_eq!(listed.len(), VARIABLES.len(), "a variable is listed twice");
    assert_eq!(documented, listed, "docs/configuration.md's table and VARIABLES differ");
    for name in listed {
        // A value no knob accepts: the parser must reject it as a bad value, not as an
        // unknown variable.
        let err = Config::default().apply_vars([(name, "\u{1}bad")]).map(|_| ());
        if let Err(FerryError::Config(m)) = &err {
            assert!(
                !m.starts_with("unknown variable"),
                "{name} is listed but not parsed: {m}"
            );
        }
    }
    let unknown = Config::default().apply_vars([("FERRY_NO_SUCH_KNOB", "1")]);
    assert!(matches!(unknown, Err(FerryError::Config(m)) if m.starts_with("unknown variable")));
}

#[test]
fn sizes_and_bools_parse() {
    assert_eq!(parse_size("X", "64K").unwrap(), 65536);
    assert_eq!(parse_size("X", "2m").unwrap(), 2 << 20);
    assert_eq!(parse_size("X", "17").unwrap(), 17);
    assert!(parse_size("X", "K").is_err());
    assert!(parse_bool("X", "maybe").is_err());
}

#[test]
fn layers_and_tier_budgets_resolve() {
    assert!("device,gpu".parse::<Layers>().is_err());
    assert!("device".parse::<Layers>().is_err(), "tiles need host or disk");
    assert!("".parse::<Layers>().is_err());
    let mut c = Config::default();
    let p = c.tier_plan(2, 64 << 30).unwrap();
    assert_eq!((p.devices, p.host_limit, p.disk.is_some()), (true, None, false));
    c.apply_vars([("FERRY_SPILL_DIR", "/tmp/x"), ("FERRY_SPILL_BYTES", "1G")])
        .unwrap();
    let p = c.tier_plan(2, 64 << 30).unwrap();
    assert_eq!(p.host_limit, Some(16 << 30), "half of the rank's share by default");
    assert_eq!(p.disk, Some((PathBuf::from("/tmp/x"), 1 << 30)));
    c.apply_vars([("FERRY_LAYERS", "device,disk")]).unwrap();
    assert_eq!(c.tier_plan(2, 64 << 30).unwrap().host_limit, Some(0));
    c.apply_vars([("FERRY_LAYERS", "host,device")]).unwrap();
    assert!(c.tier_plan(2, 64 << 30).is_err(), "spill dir without the disk tier");
    assert!(c.apply_vars([("FERRY_HOST_MEM_FRACTION", "1.5")]).is_err());
    assert!(c.apply_vars([("FERRY_SPILL_BYTES", "0")]).is_err());
    // Built in code rather than parsed: `validate` checks the same rule.
    let c = Config {
        layers: Some(Layers {
            device: true,
            host: false,
            disk: false,
        }),
        ..Config::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("need the disk tier"), "{err}");
}

#[test]
fn env_overrides_and_rejects_unknown() {
    let mut c = Config::default();
    c.apply_vars([("FERRY_WORKERS", "3"), ("FERRY_EAGER_BYTES", "1K"), ("PATH", "/bin")])
        .unwrap();
    assert_eq!(c.workers, Some(3));
    assert_eq!(c.eager_bytes, 1024);
    assert_eq!(c.host_pin_at_start, None, "pinned whole at start-up by default");
    c.apply_vars([("FERRY_HOST_PIN_AT_START", "256M")]).unwrap();
    assert_eq!(c.host_pin_at_start, Some(256 << 20));
    assert!(c.apply_vars([("FERRY_HOST_PIN_AT_START", "lots")]).is_err());
    let err = c.apply_vars([("FERRY_WROKERS", "3")]).unwrap_err();
    assert!(err.to_string().contains("unknown variable FERRY_WROKERS"), "{err}");
    assert!(c.apply_vars([("FERRY_WORKERS", "0")]).is_err());
    assert!(c.apply_vars([("FERRY_MAX_SENDS", "-1")]).is_err());
}

#[test]
fn copy_kernel_knobs_parse_and_bounds_are_checked() {
    let mut c = Config::default();
    assert_eq!((c.sm_copy_bytes, c.sm_copy_blocks), (4 << 20, 64), "4 MiB by default");
    c.apply_vars([("FERRY_SM_COPY_BYTES", "1M"), ("FERRY_SM_COPY_BLOCKS", "16")])
        .unwrap();
    assert_eq!((c.sm_copy_bytes, c.sm_copy_blocks), (1 << 20, 16));
    assert!(c.apply_vars([("FERRY_SM_COPY_BLOCKS", "0")]).is_err());
    let err = c.apply_vars([("FERRY_SM_COPY_BLOCKS", "70000")]).unwrap_err();
    assert!(err.to_string().contains("FERRY_SM_COPY_BLOCKS"), "{err}");
    assert!(c.apply_vars([("FERRY_SM_COPY_BYTES", "lots")]).is_err());
}

/// Values that parse but would overflow the runtime's arithmetic or start absurd numbers
/// of threads are configuration errors, each naming its variable.
#[test]
fn absurd_values_are_refused_by_name() {
    let max = u64::MAX.to_string();
    for (var, value) in [
        ("FERRY_WORKERS", max.as_str()),
        ("FERRY_EXEC_STREAMS", "100000"),
        ("FERRY_DEVICE_QUEUE_DEPTH", max.as_str()),
        ("FERRY_DEVICE_MEM", "18446744073709551615"),
        ("FERRY_EMU_DELAY_US", max.as_str()),
        ("FERRY_OFFER_POLL_US", "1000001"),
    ] {
        let mut c = Config::default();
        let err = c.apply_vars([(var, value)]).unwrap_err();
        assert!(err.to_string().contains(var), "{var}: {err}");
    }
    let mut c = Config::default();
    let err = c
        .apply_vars([("FERRY_FAULTS", format!("mpi-delay:{max}"))])
        .unwrap_err();
    assert!(err.to_string().contains("mpi-delay"), "{err}");
    // The largest accepted values still pass.
    let mut c = Config::default();
    c.apply_vars([
        ("FERRY_WORKERS", MAX_WORKERS.to_string()),
        ("FERRY_EXEC_STREAMS", MAX_EXEC_STREAMS.to_string()),
        ("FERRY_DEVICE_MEM", MAX_DEVICE_MEM.to_string()),
        ("FERRY_OFFER_POLL_US", "1000000".to_string()),
    ])
    .unwrap();
    assert_eq!(c.offer_poll_us, 1_000_000);
    c.apply_vars([("FERRY_OFFER_POLL_US", "0")]).unwrap();
    assert_eq!(c.offer_poll_us, 0, "0: no pull is held");
    assert_eq!(Config::default().offer_poll_us, 50);
}

#[test]
fn yield_when_idle_is_auto_on_or_off() {
    let mut c = Config::default();
    assert_eq!(c.yield_when_idle, None);
    c.apply_vars([("FERRY_YIELD_WHEN_IDLE", "on")]).unwrap();
    assert_eq!(c.yield_when_idle, Some(true));
    c.apply_vars([("FERRY_YIELD_WHEN_IDLE", "OFF")]).unwrap();
    assert_eq!(c.yield_when_idle, Some(false));
    c.apply_vars([("FERRY_YIELD_WHEN_IDLE", "auto")]).unwrap();
    assert_eq!(c.yield_when_idle, None);
    let err = c.apply_vars([("FERRY_YIELD_WHEN_IDLE", "sometimes")]).unwrap_err();
    assert!(err.to_string().contains("expected auto, on or off"), "{err}");
    assert_eq!(c.yield_when_idle, None, "a refused value changes nothing");
}

#[test]
fn inserter_helps_is_auto_on_or_off() {
    let mut c = Config::default();
    assert_eq!(c.inserter_helps, None);
    c.apply_vars([("FERRY_INSERTER_HELPS", "on")]).unwrap();
    assert_eq!(c.inserter_helps, Some(true));
    c.apply_vars([("FERRY_INSERTER_HELPS", "Off")]).unwrap();
    assert_eq!(c.inserter_helps, Some(false));
    let err = c.apply_vars([("FERRY_INSERTER_HELPS", "often")]).unwrap_err();
    assert!(err.to_string().contains("expected auto, on or off"), "{err}");
    assert_eq!(c.inserter_helps, Some(false), "a refused value changes nothing");
    c.apply_vars([("FERRY_INSERTER_HELPS", "auto")]).unwrap();
    assert_eq!(c.inserter_helps, None);
}

#[test]
fn mpi_progress_is_auto_thread_or_shared() {
    let mut c = Config::default();
    assert_eq!(c.shared_progress, None);
    c.apply_vars([("FERRY_MPI_PROGRESS", "shared")]).unwrap();
    assert_eq!(c.shared_progress, Some(true));
    c.apply_vars([("FERRY_MPI_PROGRESS", "Thread")]).unwrap();
    assert_eq!(c.shared_progress, Some(false));
    let err = c.apply_vars([("FERRY_MPI_PROGRESS", "workers")]).unwrap_err();
    assert!(err.to_string().contains("expected auto, thread or shared"), "{err}");
    assert_eq!(c.shared_progress, Some(false), "a refused value changes nothing");
    c.apply_vars([("FERRY_MPI_PROGRESS", "auto")]).unwrap();
    assert_eq!(c.shared_progress, None);
}

#[test]
fn progress_backstop_is_1_us_to_1_s() {
    let mut c = Config::default();
    assert_eq!(c.progress_backstop_us, 200);
    c.apply_vars([("FERRY_PROGRESS_BACKSTOP_US", "50")]).unwrap();
    assert_eq!(c.progress_backstop_us, 50);
    for bad in ["0", "1000001", "soon"] {
        let err = c.apply_vars([("FERRY_PROGRESS_BACKSTOP_US", bad)]).unwrap_err();
        assert!(err.to_string().contains("FERRY_PROGRESS_BACKSTOP_US"), "{bad}: {err}");
        assert_eq!(c.progress_backstop_us, 50, "{bad}: a refused value changes nothing");
    }
}
