//! The addresses of a run: the coordinator's (`--coordinator HOST:PORT`, or a launcher's host
//! and port) and where process 0 binds the store (`--coordinator-bind`), parsed with the words
//! a user needs when one is wrong; and which are loopback.

use anyhow::{bail, Result};

/// Where process 0 serves the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coordinator {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Whether `host` is a loopback address (`localhost`, `127.x.x.x`, `::1`). A host name is taken
/// for a network address (it is not resolved: what it resolves to may differ between hosts).
pub fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Parse `--coordinator HOST:PORT` (`[v6addr]:PORT` for an IPv6 address).
pub fn parse_coordinator(text: &str, what: &str) -> Result<Coordinator> {
    let (host, port) = match text.strip_prefix('[') {
        Some(rest) => match rest.split_once("]:") {
            Some((h, p)) => (h, p),
            None => bail!("{what} {text:?}: expected [IPV6]:PORT"),
        },
        None => match text.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, p),
            // `::1:8476`: an IPv6 address and a port, without the brackets that tell them apart.
            Some((h, p)) if h.parse::<std::net::Ipv6Addr>().is_ok() && p.parse::<u16>().is_ok() => {
                bail!(
                    "{what} {text:?}: an IPv6 address goes in brackets before its port: \
                     [{h}]:{p} (if {p} is the port)"
                )
            }
            _ => bail!("{what} {text:?}: expected HOST:PORT, e.g. node01:8476"),
        },
    };
    if host.is_empty() {
        bail!("{what} {text:?}: the host is empty (expected HOST:PORT, e.g. node01:8476)");
    }
    let port = parse_port(port.trim(), &format!("{what} {text:?}"))?;
    Ok(Coordinator {
        host: host.to_string(),
        port,
    })
}

pub fn parse_port(text: &str, what: &str) -> Result<u16> {
    match text.parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) => Ok(p as u16),
        _ => bail!("{what}: the port must be a number from 1 to 65535, got {text:?}"),
    }
}

/// `--coordinator-bind HOST` or `HOST:PORT` (`[v6addr]:PORT`, or a bare IPv6 address): where
/// process 0 serves the store, on the coordinator's port where it names none.
pub fn parse_bind(text: &str, port: u16) -> Result<Coordinator> {
    let what = "--coordinator-bind";
    if let Ok(c) = parse_coordinator(text, what) {
        return Ok(c);
    }
    // HOST:PORT whose port is not one (an IPv6 address has more colons).
    if let Some((_, p)) = text.split_once(':') {
        if !p.contains(':') && p.parse::<u16>().is_err() {
            bail!("{what} {text}: `{p}` is not a port number");
        }
    }
    let host = text.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        bail!("{what} {text:?}: the host is empty");
    }
    Ok(Coordinator {
        host: host.to_string(),
        port,
    })
}
