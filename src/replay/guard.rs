//! A check of a pickle's opcode stream before it is decoded: refuses every opcode that names
//! a global, builds an object or calls something, and bounds the size and depth of the value
//! it describes.
//!
//! The decoder copies a memoized value each time the stream refers to it again, so a small
//! pickle can describe an exponentially large value (a list holding the same list twice, a
//! few dozen times over), and a deeply nested one can exhaust the stack. The check builds the
//! graph of containers (shared ones once), then measures the expanded size and depth of the
//! root without expanding it.

use crate::error::{Error, Result};

/// Most values (containers and scalars, shared ones counted at each use) a snapshot may expand to.
pub const MAX_NODES: u64 = 1 << 27;
/// Deepest nesting accepted. PyTorch snapshots nest about six deep.
pub const MAX_DEPTH: u32 = 64;

/// A scalar (string, number, ...): weight one, no children.
const LEAF: u32 = u32::MAX;

enum Item {
    Mark,
    Value(u32),
}

struct Walker<'a> {
    data: &'a [u8],
    pos: usize,
    /// Children of each container.
    nodes: Vec<Vec<u32>>,
    stack: Vec<Item>,
    memo: std::collections::HashMap<u64, u32>,
}

fn bad(pos: usize, what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!(
        "not a memory snapshot: {what} (pickle offset {pos})"
    ))
}

impl<'a> Walker<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| bad(self.pos, format!("truncated: {n} more bytes announced")))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> Result<u64> {
        let b = self.take(n)?;
        Ok(b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | x as u64))
    }

    /// A length prefix of `n` bytes, then that many bytes.
    fn skip_counted(&mut self, n: usize) -> Result<()> {
        let len = self.uint(n)?;
        self.take(usize::try_from(len).unwrap_or(usize::MAX))?;
        Ok(())
    }

    fn line(&mut self) -> Result<&'a [u8]> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad(self.pos, "truncated: unterminated text argument"))?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }

    fn pop(&mut self) -> Result<u32> {
        match self.stack.pop() {
            Some(Item::Value(v)) => Ok(v),
            _ => Err(bad(self.pos, "stack underflow")),
        }
    }

    fn top_container(&mut self) -> Result<u32> {
        match self.stack.last() {
            Some(Item::Value(v)) if *v != LEAF => Ok(*v),
            _ => Err(bad(
                self.pos,
                "item added to something that is not a container",
            )),
        }
    }

    fn pop_to_mark(&mut self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        loop {
            match self.stack.pop() {
                Some(Item::Value(v)) => out.push(v),
                Some(Item::Mark) => break,
                None => return Err(bad(self.pos, "missing mark")),
            }
        }
        out.reverse();
        Ok(out)
    }

    fn container(&mut self, children: Vec<u32>) -> Result<()> {
        if self.nodes.len() >= (LEAF - 1) as usize {
            return Err(bad(self.pos, "too many containers"));
        }
        self.nodes.push(children);
        self.stack.push(Item::Value((self.nodes.len() - 1) as u32));
        Ok(())
    }

    fn extend_top(&mut self, items: Vec<u32>) -> Result<()> {
        let top = self.top_container()?;
        self.nodes[top as usize].extend(items);
        Ok(())
    }

    fn memo_put(&mut self, key: u64) -> Result<()> {
        match self.stack.last() {
            Some(Item::Value(v)) => {
                self.memo.insert(key, *v);
                Ok(())
            }
            _ => Err(bad(self.pos, "memoizing nothing")),
        }
    }

    fn memo_get(&mut self, key: u64) -> Result<()> {
        let v = *self
            .memo
            .get(&key)
            .ok_or_else(|| bad(self.pos, format!("memo entry {key} was never stored")))?;
        self.stack.push(Item::Value(v));
        Ok(())
    }

    fn ascii_number(&mut self) -> Result<u64> {
        let pos = self.pos;
        let text = self.line()?;
        std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .ok_or_else(|| bad(pos, "malformed memo key"))
    }

    fn run(&mut self) -> Result<u32> {
        loop {
            let at = self.pos;
            let op = *self
                .data
                .get(self.pos)
                .ok_or_else(|| bad(at, "truncated: no STOP opcode"))?;
            self.pos += 1;
            match op {
                b'.' => return self.pop(),
                0x80 => {
                    self.take(1)?;
                }
                0x95 => {
                    self.take(8)?;
                }
                b'(' => self.stack.push(Item::Mark),
                b'0' => {
                    self.stack.pop().ok_or_else(|| bad(at, "stack underflow"))?;
                }
                b'1' => {
                    self.pop_to_mark()?;
                }
                b'2' => {
                    let v = self.pop()?;
                    self.stack.push(Item::Value(v));
                    self.stack.push(Item::Value(v));
                }
                // Scalars.
                b'N' | 0x88 | 0x89 => self.stack.push(Item::Value(LEAF)),
                b'K' => self.leaf(1)?,
                b'M' => self.leaf(2)?,
                b'J' => self.leaf(4)?,
                b'G' => self.leaf(8)?,
                b'F' | b'I' | b'L' | b'S' | b'V' => {
                    self.line()?;
                    self.stack.push(Item::Value(LEAF));
                }
                0x8a | b'U' | b'C' | 0x8c => self.counted_leaf(1)?,
                0x8b | b'T' | b'X' | b'B' => self.counted_leaf(4)?,
                0x8d | 0x8e | 0x96 => self.counted_leaf(8)?,
                // Containers.
                b'}' | b']' | b')' | 0x8f => self.container(Vec::new())?,
                b'd' | b'l' | b't' | 0x91 => {
                    let items = self.pop_to_mark()?;
                    self.container(items)?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.container(items)?;
                }
                b'a' => {
                    let v = self.pop()?;
                    self.extend_top(vec![v])?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend_top(vec![k, v])?;
                }
                b'e' | b'u' | 0x90 => {
                    let items = self.pop_to_mark()?;
                    self.extend_top(items)?;
                }
                // Memo.
                b'p' => {
                    let key = self.ascii_number()?;
                    self.memo_put(key)?;
                }
                b'q' => {
                    let key = self.uint(1)?;
                    self.memo_put(key)?;
                }
                b'r' => {
                    let key = self.uint(4)?;
                    self.memo_put(key)?;
                }
                0x94 => {
                    let key = self.memo.len() as u64;
                    self.memo_put(key)?;
                }
                b'g' => {
                    let key = self.ascii_number()?;
                    self.memo_get(key)?;
                }
                b'h' => {
                    let key = self.uint(1)?;
                    self.memo_get(key)?;
                }
                b'j' => {
                    let key = self.uint(4)?;
                    self.memo_get(key)?;
                }
                b'c' | 0x93 | b'i' => {
                    return Err(bad(
                        at,
                        "it refers to a Python global (class or function); snapshots hold only dicts, lists, strings and numbers, and globals are refused",
                    ))
                }
                b'R' | b'o' | 0x81 | 0x92 | b'b' | b'P' | b'Q' | 0x82..=0x84 | 0x97 | 0x98 => {
                    return Err(bad(
                        at,
                        format!("opcode {op:#04x} builds or calls a Python object; refused"),
                    ))
                }
                _ => return Err(bad(at, format!("unknown pickle opcode {op:#04x}"))),
            }
        }
    }

    fn leaf(&mut self, n: usize) -> Result<()> {
        self.take(n)?;
        self.stack.push(Item::Value(LEAF));
        Ok(())
    }

    fn counted_leaf(&mut self, n: usize) -> Result<()> {
        self.skip_counted(n)?;
        self.stack.push(Item::Value(LEAF));
        Ok(())
    }

    /// Expanded size and depth of `root`, refusing cycles, without recursion.
    fn measure(&self, root: u32) -> Result<()> {
        if root == LEAF {
            return Ok(());
        }
        // Per node: 0 = unseen, 1 = on the path, 2 = done.
        let mut color = vec![0u8; self.nodes.len()];
        let mut weight = vec![0u64; self.nodes.len()];
        let mut depth = vec![0u32; self.nodes.len()];
        let mut path: Vec<(u32, usize)> = vec![(root, 0)];
        color[root as usize] = 1;
        while let Some(&mut (node, ref mut next)) = path.last_mut() {
            let children = &self.nodes[node as usize];
            if let Some(&child) = children.get(*next) {
                *next += 1;
                if child == LEAF {
                    continue;
                }
                match color[child as usize] {
                    0 => {
                        if path.len() as u32 >= MAX_DEPTH {
                            return Err(Error::InvalidArgument(format!(
                                "not a memory snapshot: nested more than {MAX_DEPTH} deep"
                            )));
                        }
                        color[child as usize] = 1;
                        path.push((child, 0));
                    }
                    1 => {
                        return Err(Error::InvalidArgument(
                            "not a memory snapshot: a container contains itself".into(),
                        ))
                    }
                    _ => {}
                }
                continue;
            }
            let mut w = 1u64;
            let mut d = 1u32;
            for &c in children {
                let (cw, cd) = if c == LEAF {
                    (1, 0)
                } else {
                    (weight[c as usize], depth[c as usize])
                };
                w = w.saturating_add(cw);
                d = d.max(cd + 1);
            }
            if w > MAX_NODES {
                return Err(Error::InvalidArgument(format!(
                    "not a memory snapshot: it expands to more than {MAX_NODES} values"
                )));
            }
            if d > MAX_DEPTH {
                return Err(Error::InvalidArgument(format!(
                    "not a memory snapshot: nested more than {MAX_DEPTH} deep"
                )));
            }
            weight[node as usize] = w;
            depth[node as usize] = d;
            color[node as usize] = 2;
            path.pop();
        }
        Ok(())
    }
}

/// Checks that `data` is a pickle of plain data (no globals, no object construction) whose
/// decoded value stays within [`MAX_NODES`] values and [`MAX_DEPTH`] levels.
pub fn check(data: &[u8]) -> Result<()> {
    // PyTorch writes protocol 2 or later, which always starts with PROTO.
    if data.first() != Some(&0x80) {
        return Err(Error::InvalidArgument(
            "not a memory snapshot: not a pickle of protocol 2 or later (nor gzip of one)".into(),
        ));
    }
    let mut w = Walker {
        data,
        pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: std::collections::HashMap::new(),
    };
    let root = w.run()?;
    w.measure(root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_dict_passes() {
        // {'a': [1, 2]} at protocol 2.
        let p = b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01]q\x02(K\x01K\x02es.";
        check(p).unwrap();
    }

    #[test]
    fn a_global_is_refused() {
        let p = b"\x80\x02cos\nsystem\nq\x00.";
        let e = check(p).unwrap_err();
        assert!(e.message().contains("global"), "{e}");
    }

    #[test]
    fn an_exponential_memo_bomb_is_refused() {
        // l0 = []; l(k+1) = [lk, lk], 40 times: 2^40 values when expanded.
        let mut p = b"\x80\x02]q\x00".to_vec();
        for k in 0..40u8 {
            p.extend_from_slice(b"]q");
            p.push(k + 1);
            p.extend_from_slice(b"(h");
            p.push(k);
            p.extend_from_slice(b"h");
            p.push(k);
            p.extend_from_slice(b"e0");
        }
        p.extend_from_slice(b"h\x28.");
        let e = check(&p).unwrap_err();
        assert!(e.message().contains("expands to more than"), "{e}");
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut p = b"\x80\x02".to_vec();
        p.extend(std::iter::repeat_n(b']', 10_000));
        p.extend(std::iter::repeat_n(b'a', 9_999));
        p.push(b'.');
        let e = check(&p).unwrap_err();
        assert!(e.message().contains("deep"), "{e}");
    }

    #[test]
    fn a_huge_announced_length_is_truncation() {
        let p = b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f";
        let e = check(p).unwrap_err();
        assert!(e.message().contains("truncated"), "{e}");
    }
}
