//! Facts about the machine that sizes are checked against.

/// This machine's memory in bytes (Linux: `MemTotal` of `/proc/meminfo`;
/// `None` where it cannot be read): what a request for more is refused
/// against before anything is allocated or written.
pub fn physical_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.trim_start_matches("MemTotal:").trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn linux_reports_a_plausible_memory_size() {
        let bytes = super::physical_memory().expect("/proc/meminfo has MemTotal");
        assert!((1 << 26..1 << 50).contains(&bytes), "{bytes} bytes");
    }
}
