//! A small JSON value with a deterministic writer (keys in insertion order, shortest
//! round-tripping numbers) and a strict reader; plus plan (de)serialization.
use super::cluster::Cluster;
use super::schedule::NicSlice;
use super::stages::{NativePiece, Stage, StageCost};
use super::traffic::{Native, Route, Traffic};
use super::Plan;
use crate::error::{Error, Result};
use std::fmt::Write;

const OP: &str = "plan::json";

#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// Integers are kept exact (byte counts reach 2^63).
    Int(i128),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub fn obj(fields: Vec<(&str, Json)>) -> Json {
        Json::Obj(fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    }
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(f) => f.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Json::Int(i) => Some(i as f64),
            Json::Num(x) => Some(x),
            _ => None,
        }
    }
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Json::Int(i) => u64::try_from(i).ok(),
            _ => None,
        }
    }
    pub fn as_arr(&self) -> Option<&[Json]> {
        match self {
            Json::Arr(a) => Some(a),
            _ => None,
        }
    }

    pub fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(i) => write!(out, "{i}").unwrap(),
            Json::Num(x) if x.is_finite() => write!(out, "{x:?}").unwrap(),
            Json::Num(_) => out.push_str("null"),
            Json::Str(s) => write_str(out, s),
            Json::Arr(a) => {
                out.push('[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.write(out);
                }
                out.push(']');
            }
            Json::Obj(f) => {
                out.push('{');
                for (i, (k, v)) in f.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_str(out, k);
                    out.push(':');
                    v.write(out);
                }
                out.push('}');
            }
        }
    }

    pub fn parse(text: &str) -> Result<Json> {
        let mut p = Parser { s: text.as_bytes(), i: 0 };
        let v = p.value(0)?;
        p.ws();
        if p.i != p.s.len() {
            return Err(p.err("trailing characters"));
        }
        Ok(v)
    }
}

impl std::fmt::Display for Json {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        self.write(&mut s);
        f.write_str(&s)
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).unwrap(),
            c => out.push(c),
        }
    }
    out.push('"');
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> Error {
        Error::invalid_arg(OP, format!("{what} at byte {}", self.i))
    }
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }
    fn value(&mut self, depth: usize) -> Result<Json> {
        if depth > 64 {
            return Err(self.err("nesting too deep"));
        }
        self.ws();
        match self.s.get(self.i) {
            None => Err(self.err("unexpected end")),
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') if self.eat("true") => Ok(Json::Bool(true)),
            Some(b'f') if self.eat("false") => Ok(Json::Bool(false)),
            Some(b'n') if self.eat("null") => Ok(Json::Null),
            Some(c) if *c == b'-' || c.is_ascii_digit() => self.number(),
            Some(_) => Err(self.err("unexpected character")),
        }
    }
    fn object(&mut self, depth: usize) -> Result<Json> {
        self.i += 1;
        let mut f = Vec::new();
        self.ws();
        if self.eat("}") {
            return Ok(Json::Obj(f));
        }
        loop {
            self.ws();
            if self.s.get(self.i) != Some(&b'"') {
                return Err(self.err("expected a key"));
            }
            let k = self.string()?;
            self.ws();
            if !self.eat(":") {
                return Err(self.err("expected ':'"));
            }
            f.push((k, self.value(depth + 1)?));
            self.ws();
            if self.eat("}") {
                return Ok(Json::Obj(f));
            }
            if !self.eat(",") {
                return Err(self.err("expected ',' or '}'"));
            }
        }
    }
    fn array(&mut self, depth: usize) -> Result<Json> {
        self.i += 1;
        let mut a = Vec::new();
        self.ws();
        if self.eat("]") {
            return Ok(Json::Arr(a));
        }
        loop {
            a.push(self.value(depth + 1)?);
            self.ws();
            if self.eat("]") {
                return Ok(Json::Arr(a));
            }
            if !self.eat(",") {
                return Err(self.err("expected ',' or ']'"));
            }
        }
    }
    fn string(&mut self) -> Result<String> {
        self.i += 1;
        let mut out = String::new();
        loop {
            let c = *self.s.get(self.i).ok_or_else(|| self.err("unterminated string"))?;
            self.i += 1;
            match c {
                b'"' => return Ok(out),
                b'\\' => {
                    let e = *self.s.get(self.i).ok_or_else(|| self.err("bad escape"))?;
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'n' => out.push('\n'),
                        b't' => out.push('\t'),
                        b'r' => out.push('\r'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or_else(|| self.err("bad \\u"))?;
                            let code = u32::from_str_radix(std::str::from_utf8(hex).unwrap_or("x"), 16).map_err(|_| self.err("bad \\u"))?;
                            out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                            self.i += 4;
                        }
                        _ => return Err(self.err("bad escape")),
                    }
                }
                _ => {
                    // Copy one UTF-8 sequence.
                    let start = self.i - 1;
                    let mut end = self.i;
                    while end < self.s.len() && (self.s[end] & 0xC0) == 0x80 {
                        end += 1;
                    }
                    out.push_str(std::str::from_utf8(&self.s[start..end]).map_err(|_| self.err("bad UTF-8"))?);
                    self.i = end;
                }
            }
        }
    }
    fn number(&mut self) -> Result<Json> {
        let start = self.i;
        while self.i < self.s.len() && matches!(self.s[self.i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
            self.i += 1;
        }
        let t = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
        if let Ok(i) = t.parse::<i128>() {
            return Ok(Json::Int(i));
        }
        t.parse::<f64>().map(Json::Num).map_err(|_| self.err("bad number"))
    }
}

// ------------------------------------------------------------------ plan <-> JSON ------

fn ints(v: &[u64]) -> Json {
    Json::Arr(v.iter().map(|&x| Json::Int(x as i128)).collect())
}
fn int(x: impl Into<i128>) -> Json {
    Json::Int(x.into())
}

/// Reads the `i`-th field of a flat integer tuple array.
fn tuple(v: &Json, n: usize) -> Result<Vec<u64>> {
    let a = v.as_arr().filter(|a| a.len() == n).ok_or_else(|| Error::invalid_arg(OP, format!("expected an array of {n} integers")))?;
    a.iter().map(|x| x.as_u64().ok_or_else(|| Error::invalid_arg(OP, "expected a non-negative integer"))).collect()
}

fn field<'a>(v: &'a Json, k: &str) -> Result<&'a Json> {
    v.get(k).ok_or_else(|| Error::invalid_arg(OP, format!("missing field `{k}`")))
}

fn num(v: &Json, k: &str) -> Result<f64> {
    field(v, k)?.as_f64().ok_or_else(|| Error::invalid_arg(OP, format!("`{k}` is not a number")))
}

fn uint(v: &Json, k: &str) -> Result<u64> {
    field(v, k)?.as_u64().ok_or_else(|| Error::invalid_arg(OP, format!("`{k}` is not a non-negative integer")))
}

/// The rows of array `k`, each of one of the lengths `n` (the first named in errors).
fn rows<T>(v: &Json, k: &str, n: &[usize], f: impl Fn(&[u64]) -> T) -> Result<Vec<T>> {
    let a = field(v, k)?.as_arr().ok_or_else(|| Error::invalid_arg(OP, format!("`{k}` is not an array")))?;
    a.iter().map(|x| tuple(x, x.as_arr().map(|r| r.len()).filter(|l| n.contains(l)).unwrap_or(n[0])).map(|t| f(&t))).collect()
}

impl Cluster {
    pub fn to_json(&self) -> Json {
        let us = |v: &[usize]| ints(&v.iter().map(|&x| x as u64).collect::<Vec<_>>());
        Json::obj(vec![
            ("nodes", int(self.nodes as u64)),
            ("gpus_per_node", int(self.gpus_per_node as u64)),
            ("nics_per_node", int(self.nics_per_node as u64)),
            ("forwarding_peer", us(&self.forwarding_peer)),
            ("nic_of_gpu", us(&self.nic_of_gpu)),
            ("nic_bw", Json::Num(self.nic_bw)),
            ("nvlink_bw", Json::Num(self.nvlink_bw)),
            ("ce_bw", Json::Num(self.ce_bw)),
            ("ce_per_gpu", int(self.ce_per_gpu as u64)),
            ("balance_nics", Json::Bool(self.balance_nics)),
        ])
    }

    pub fn from_json(v: &Json) -> Result<Cluster> {
        let list = |k: &str| -> Result<Vec<usize>> {
            let a = field(v, k)?.as_arr().ok_or_else(|| Error::invalid_arg(OP, format!("`{k}` is not an array")))?;
            a.iter().map(|x| x.as_u64().map(|u| u as usize).ok_or_else(|| Error::invalid_arg(OP, format!("bad `{k}`")))).collect()
        };
        let cl = Cluster {
            nodes: uint(v, "nodes")? as usize,
            gpus_per_node: uint(v, "gpus_per_node")? as usize,
            nics_per_node: uint(v, "nics_per_node")? as usize,
            forwarding_peer: list("forwarding_peer")?,
            nic_of_gpu: list("nic_of_gpu")?,
            nic_bw: num(v, "nic_bw")?,
            nvlink_bw: num(v, "nvlink_bw")?,
            ce_bw: num(v, "ce_bw")?,
            ce_per_gpu: uint(v, "ce_per_gpu")? as usize,
            balance_nics: match v.get("balance_nics") {
                None => false,
                Some(Json::Bool(b)) => *b,
                Some(_) => return Err(Error::invalid_arg(OP, "`balance_nics` is not a boolean")),
            },
        };
        cl.validate()?;
        Ok(cl)
    }
}

impl Plan {
    /// The whole plan; `Plan::from_json` reads it back into an equal plan.
    pub fn to_json(&self) -> Json {
        let t = &self.traffic;
        let row = |v: &[u64]| ints(v);
        Json::obj(vec![
            ("format", Json::Str("hoccl-plan-1".into())),
            ("collective", Json::Str(self.collective.clone())),
            ("chunk_bytes", int(self.chunk_bytes)),
            ("cluster", self.cluster.to_json()),
            ("natives", Json::Arr(t.natives.iter().map(|n| row(&[n.src as u64, n.dst as u64, n.bytes])).collect())),
            ("fan_out", Json::Bool(t.fan_out)),
            ("routes", Json::Arr(t.routes.iter().map(|r| row(&[r.src as u64, r.dst as u64, r.bytes, r.su as u64, r.rv as u64, r.offset])).collect())),
            ("nic", Json::Arr(self.nic.iter().map(|x| row(&[x.route as u64, x.stage as u64, x.offset, x.bytes])).collect())),
            ("native_pieces", Json::Arr(self.native_pieces.iter().map(|p| row(&[p.native as u64, p.stage as u64, p.offset, p.bytes])).collect())),
            (
                "stages",
                Json::Arr(
                    self.stages
                        .iter()
                        .map(|s| {
                            Json::obj(vec![
                                ("nic", row(&[s.nic.0 as u64, s.nic.1 as u64])),
                                ("native", row(&[s.native.0 as u64, s.native.1 as u64])),
                                ("nic_s", Json::Num(s.cost.nic_s)),
                                ("nvlink_s", Json::Num(s.cost.nvlink_s)),
                                ("ce_s", Json::Num(s.cost.ce_s)),
                            ])
                        })
                        .collect(),
                ),
            ),
        ])
    }

    pub fn from_json(v: &Json) -> Result<Plan> {
        let u32s = |x: u64| x as u32;
        let natives = rows(v, "natives", &[3], |t| Native { src: u32s(t[0]), dst: u32s(t[1]), bytes: t[2] })?;
        // A route's offset in its flow is the sixth column; plans of whole routes may omit it.
        let routes = rows(v, "routes", &[6, 5], |t| Route { src: u32s(t[0]), dst: u32s(t[1]), offset: t.get(5).copied().unwrap_or(0), bytes: t[2], su: u32s(t[3]), rv: u32s(t[4]) })?;
        let fan_out = match field(v, "fan_out")? {
            Json::Bool(b) => *b,
            _ => return Err(Error::invalid_arg(OP, "`fan_out` is not a boolean")),
        };
        let nic = rows(v, "nic", &[4], |t| NicSlice { route: u32s(t[0]), stage: u32s(t[1]), offset: t[2], bytes: t[3] })?;
        let native_pieces = rows(v, "native_pieces", &[4], |t| NativePiece { native: u32s(t[0]), stage: u32s(t[1]), offset: t[2], bytes: t[3] })?;
        let st = field(v, "stages")?.as_arr().ok_or_else(|| Error::invalid_arg(OP, "`stages` is not an array"))?;
        let mut stages = Vec::with_capacity(st.len());
        for s in st {
            let a = tuple(field(s, "nic")?, 2)?;
            let b = tuple(field(s, "native")?, 2)?;
            let cost = StageCost { nic_s: num(s, "nic_s")?, nvlink_s: num(s, "nvlink_s")?, ce_s: num(s, "ce_s")? };
            if a[0] > a[1] || a[1] as usize > nic.len() || b[0] > b[1] || b[1] as usize > native_pieces.len() {
                return Err(Error::invalid_arg(OP, "stage range out of bounds"));
            }
            stages.push(Stage { nic: (a[0] as usize, a[1] as usize), native: (b[0] as usize, b[1] as usize), cost });
        }
        let cluster = Cluster::from_json(field(v, "cluster")?)?;
        let g = cluster.num_gpus() as u32;
        let dst_limit = if fan_out { cluster.nodes as u32 } else { g };
        let cross = |r: &Route| if fan_out { cluster.node_of(r.src as usize) != r.dst as usize } else { cluster.node_of(r.src as usize) != cluster.node_of(r.dst as usize) };
        if routes.iter().any(|r| r.src >= g || r.dst >= dst_limit || !cross(r)) || natives.iter().any(|n| n.src >= g || n.dst >= g) {
            return Err(Error::invalid_arg(OP, "a flow names a GPU outside the cluster"));
        }
        let dst_node = |r: &Route| if fan_out { r.dst as usize } else { cluster.node_of(r.dst as usize) };
        if routes.iter().any(|r| r.su >= g || r.rv >= g || cluster.node_of(r.su as usize) != cluster.node_of(r.src as usize) || cluster.node_of(r.rv as usize) != dst_node(r)) {
            return Err(Error::invalid_arg(OP, "a route's staging GPU is not on its node"));
        }
        if nic.iter().any(|x| x.route as usize >= routes.len()) || native_pieces.iter().any(|p| p.native as usize >= natives.len()) {
            return Err(Error::invalid_arg(OP, "a piece names a flow that does not exist"));
        }
        let collective = match field(v, "collective")? {
            Json::Str(s) => s.clone(),
            _ => return Err(Error::invalid_arg(OP, "`collective` is not a string")),
        };
        Ok(Plan { cluster, collective, chunk_bytes: uint(v, "chunk_bytes")?.max(1), traffic: Traffic { fan_out, natives, routes }, nic, native_pieces, stages })
    }
}
