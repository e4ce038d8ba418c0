//! The speed of the network link a node reaches its job by, as the kernel reports it.
//!
//! The derived partition size needs the link rate (`sumflow_plan::partition`): at
//! 100 Gbit/s a partition sized for 1 Gbit/s passes faster than the CPU handles its
//! message. A node registers the speed of the interface that holds the local address of
//! its connection to the coordinator, read from `/sys/class/net/<interface>/speed` (the
//! negotiated rate of a physical NIC, in Mbit/s). Loopback and virtual interfaces that
//! report no speed give 0, "unknown", and the job derives its sizes without a rate.

use std::ffi::CStr;
use std::net::IpAddr;
use std::path::Path;

/// The speed in Mbit/s of the interface holding `local`, or 0 when it is unknown.
pub fn link_mbit(local: IpAddr) -> u32 {
    interface_of(local).map_or(0, |name| speed_mbit(Path::new("/sys/class/net"), &name))
}

/// The link speed `/sys/class/net/<name>/speed` (under `root`) reports; 0 when it reports
/// none (`-1`, an error on reading, as loopback and down links give) or nonsense.
fn speed_mbit(root: &Path, name: &str) -> u32 {
    std::fs::read_to_string(root.join(name).join("speed"))
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .and_then(|mbit| u32::try_from(mbit).ok())
        .unwrap_or(0)
}

/// The name of the interface that holds `addr`, from `getifaddrs`.
fn interface_of(addr: IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut entry = list;
    while !entry.is_null() && found.is_none() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, not yet freed; its
        // address, when not null, is a sockaddr of the family it names, and its name a C
        // string.
        unsafe {
            let ifa = &*entry;
            if !ifa.ifa_addr.is_null() && address_of(ifa.ifa_addr) == Some(addr) {
                found = Some(CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned());
            }
            entry = ifa.ifa_next;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once, after its last use.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// The IP address of an interface's socket address, for the IPv4 and IPv6 families.
///
/// # Safety
/// `sa` must point to a valid socket address of the family in its `sa_family`.
unsafe fn address_of(sa: *const libc::sockaddr) -> Option<IpAddr> {
    // SAFETY: the caller's contract: `sa` is a valid socket address of its family, so it
    // may be read as that family's struct.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let v4 = &*sa.cast::<libc::sockaddr_in>();
                Some(IpAddr::from(v4.sin_addr.s_addr.to_ne_bytes()))
            }
            libc::AF_INET6 => {
                let v6 = &*sa.cast::<libc::sockaddr_in6>();
                Some(IpAddr::from(v6.sin6_addr.s6_addr))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_and_has_no_speed() {
        assert_eq!(
            interface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(link_mbit("127.0.0.1".parse().unwrap()), 0);
        // No interface holds a documentation address.
        assert_eq!(interface_of("192.0.2.77".parse().unwrap()), None);
        assert_eq!(link_mbit("192.0.2.77".parse().unwrap()), 0);
    }

    #[test]
    fn the_kernels_speed_file_is_read_and_unknowns_are_zero() {
        let dir = std::env::temp_dir().join(format!("sumflow-nic-{}", std::process::id()));
        for (name, text) in [("eth0", "100000\n"), ("veth1", "-1\n"), ("odd", "fast\n")] {
            std::fs::create_dir_all(dir.join(name)).unwrap();
            std::fs::write(dir.join(name).join("speed"), text).unwrap();
        }
        assert_eq!(speed_mbit(&dir, "eth0"), 100_000);
        assert_eq!(speed_mbit(&dir, "veth1"), 0);
        assert_eq!(speed_mbit(&dir, "odd"), 0);
        assert_eq!(speed_mbit(&dir, "missing"), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
