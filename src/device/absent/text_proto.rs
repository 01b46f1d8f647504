//! The text form of a protocol buffer message, read far enough to check a GPU description
//! before a plugin sees it: fields with the line each starts on, values as written. Follows
//! protobuf's text format (`name: value`, `name { ... }` or `name < ... >`, `[a, b]` lists,
//! `#` comments, `,`/`;` separators, adjacent strings joined).

use anyhow::{bail, Result};

/// One field as written.
#[derive(Debug)]
pub struct Field {
    pub name: String,
    /// 1-based line the field's name is on.
    pub line: usize,
    pub value: Value,
}

#[derive(Debug)]
pub enum Value {
    /// A number, identifier (enum value, `true`) or string (unquoted and unescaped).
    Scalar(String),
    Message(Vec<Field>),
    /// `[a, b]`: parsed so that a description may hold one; no field xtrain checks is one.
    #[allow(dead_code)]
    List(Vec<Value>),
}

impl Value {
    pub fn fields(&self) -> &[Field] {
        match self {
            Value::Message(f) => f,
            _ => &[],
        }
    }
}

/// The first field called `name` among `fields`.
pub fn get<'a>(fields: &'a [Field], name: &str) -> Option<&'a Field> {
    fields.iter().find(|f| f.name == name)
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// A name, number or identifier.
    Word(String),
    Str(String),
    Punct(char),
}

fn describe(t: Option<&(Tok, usize)>) -> String {
    match t {
        None => "the end of the file".into(),
        Some((Tok::Word(w), _)) => format!("`{w}`"),
        Some((Tok::Str(s), _)) => format!("the string \"{s}\""),
        Some((Tok::Punct(c), _)) => format!("`{c}`"),
    }
}

fn tokens(text: &str) -> Result<Vec<(Tok, usize)>> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    let mut line = 1;
    while let Some(&c) = chars.peek() {
        match c {
            '\n' => {
                line += 1;
                chars.next();
            }
            c if c.is_whitespace() => {
                chars.next();
            }
            '#' => {
                while chars.peek().is_some_and(|&c| c != '\n') {
                    chars.next();
                }
            }
            '"' | '\'' => {
                let start = line;
                chars.next();
                let mut s = String::new();
                loop {
                    match chars.next() {
                        None | Some('\n') => {
                            bail!("line {start}: a string is not closed on its line")
                        }
                        Some('\\') => match chars.next() {
                            Some('n') => s.push('\n'),
                            Some('t') => s.push('\t'),
                            Some(e) => s.push(e),
                            None => bail!("line {start}: a string is not closed"),
                        },
                        Some(q) if q == c => break,
                        Some(x) => s.push(x),
                    }
                }
                out.push((Tok::Str(s), start));
            }
            ':' | '{' | '}' | '<' | '>' | '[' | ']' | ',' | ';' | '/' => {
                out.push((Tok::Punct(c), line));
                chars.next();
            }
            c if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+') => {
                let mut w = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+') {
                        w.push(c);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push((Tok::Word(w), line));
            }
            other => bail!("line {line}: unexpected character `{other}`"),
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<(Tok, usize)>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&(Tok, usize)> {
        self.toks.get(self.at)
    }

    fn is(&self, c: char) -> bool {
        matches!(self.peek(), Some((Tok::Punct(p), _)) if *p == c)
    }

    /// The line of the next token, or of the last one at the end.
    fn line(&self) -> usize {
        self.peek().or(self.toks.last()).map_or(1, |(_, l)| *l)
    }

    /// Fields until `close` (None: the end of the file).
    fn message(&mut self, close: Option<(char, usize)>) -> Result<Vec<Field>> {
        let mut fields = Vec::new();
        loop {
            match (self.peek(), close) {
                (None, None) => return Ok(fields),
                (None, Some((c, opened))) => bail!(
                    "line {opened}: the `{}` opened here is never closed with `{c}`",
                    if c == '}' { '{' } else { '<' }
                ),
                (Some((Tok::Punct(p), _)), Some((c, _))) if *p == c => {
                    self.at += 1;
                    return Ok(fields);
                }
                _ => {}
            }
            fields.push(self.field()?);
            if self.is(',') || self.is(';') {
                self.at += 1;
            }
        }
    }

    fn field(&mut self) -> Result<Field> {
        let line = self.line();
        let name = match self.peek().cloned() {
            Some((Tok::Word(w), _)) if !w.starts_with(|c: char| c.is_ascii_digit()) => {
                self.at += 1;
                w
            }
            // An extension or Any type URL: [pkg.ext] or [type.googleapis.com/pkg.Msg].
            Some((Tok::Punct('['), _)) => {
                self.at += 1;
                let mut n = String::from("[");
                loop {
                    match self.peek().cloned() {
                        Some((Tok::Word(w), _)) => n.push_str(&w),
                        Some((Tok::Punct('/'), _)) => n.push('/'),
                        Some((Tok::Punct(']'), _)) => break,
                        t => bail!(
                            "line {}: expected an extension name, found {}",
                            self.line(),
                            describe(t.as_ref())
                        ),
                    }
                    self.at += 1;
                }
                self.at += 1;
                n.push(']');
                n
            }
            t => bail!(
                "line {line}: expected a field name, found {}",
                describe(t.as_ref())
            ),
        };
        let colon = self.is(':');
        if colon {
            self.at += 1;
        }
        let value = if self.is('{') || self.is('<') || self.is('[') {
            self.value()?
        } else if colon {
            self.scalar(&name)?
        } else {
            bail!(
                "line {}: expected `:` or `{{` after `{name}`, found {}",
                self.line(),
                describe(self.peek())
            );
        };
        Ok(Field { name, line, value })
    }

    /// A message, a list, or a scalar.
    fn value(&mut self) -> Result<Value> {
        let line = self.line();
        if self.is('{') || self.is('<') {
            let close = if self.is('{') { '}' } else { '>' };
            self.at += 1;
            return Ok(Value::Message(self.message(Some((close, line)))?));
        }
        if self.is('[') {
            self.at += 1;
            let mut items = Vec::new();
            if self.is(']') {
                self.at += 1;
                return Ok(Value::List(items));
            }
            loop {
                items.push(self.value()?);
                if self.is(',') {
                    self.at += 1;
                } else if self.is(']') {
                    self.at += 1;
                    return Ok(Value::List(items));
                } else {
                    bail!(
                        "line {}: expected `,` or `]` in the list opened on line {line}, found {}",
                        self.line(),
                        describe(self.peek())
                    );
                }
            }
        }
        self.scalar("the list")
    }

    fn scalar(&mut self, of: &str) -> Result<Value> {
        match self.peek().cloned() {
            Some((Tok::Word(w), _)) => {
                self.at += 1;
                Ok(Value::Scalar(w))
            }
            Some((Tok::Str(mut s), _)) => {
                self.at += 1;
                // Adjacent strings are one.
                while let Some((Tok::Str(more), _)) = self.peek().cloned() {
                    s.push_str(&more);
                    self.at += 1;
                }
                Ok(Value::Scalar(s))
            }
            t => bail!(
                "line {}: expected a value for `{of}`, found {}",
                self.line(),
                describe(t.as_ref())
            ),
        }
    }
}

/// The fields of a message in text form, or the first syntax error, naming its line.
pub fn parse(text: &str) -> Result<Vec<Field>> {
    let mut p = Parser {
        toks: tokens(text)?,
        at: 0,
    };
    p.message(None)
}

/// An integer field's value (decimal or 0x hex), or why not.
pub fn int(f: &Field) -> std::result::Result<i64, String> {
    let Value::Scalar(s) = &f.value else {
        return Err("not a number".into());
    };
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let v = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(hex) => i64::from_str_radix(hex, 16),
        None => digits.parse::<i64>(),
    }
    .map_err(|_| format!("`{s}` is not an integer"))?;
    Ok(if neg { -v } else { v })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text format's forms parse (comments, `<>` blocks, lists, separators, extension
    /// names, joined strings, hex); errors name their line.
    #[test]
    fn text_protos_parse_in_every_form_and_errors_name_the_line() {
        let fields = parse(
            "# a comment\na { b: 0x10, c < d: \"x\" 'y' >; }\nlist: [1, 2] [ext.name] { e: f }\n",
        )
        .unwrap();
        let a = get(&fields, "a").unwrap();
        assert_eq!(a.line, 2);
        assert_eq!(int(get(a.value.fields(), "b").unwrap()), Ok(16));
        let c = get(a.value.fields(), "c").unwrap();
        match &get(c.value.fields(), "d").unwrap().value {
            Value::Scalar(s) => assert_eq!(s, "xy"),
            v => panic!("{v:?}"),
        }
        assert!(matches!(
            get(&fields, "list").unwrap().value,
            Value::List(ref l) if l.len() == 2
        ));
        assert!(get(&fields, "[ext.name]").is_some());
        for (text, says) in [
            (
                "a: 1\nb 2\n",
                "line 2: expected `:` or `{` after `b`, found `2`",
            ),
            (
                "a {\n b: 1\n",
                "line 1: the `{` opened here is never closed with `}`",
            ),
            ("a: 1\n}\n", "line 2: expected a field name, found `}`"),
            ("a: \"open\n", "line 1: a string is not closed on its line"),
            (
                "a:\n",
                "line 1: expected a value for `a`, found the end of the file",
            ),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert_eq!(e, says, "{text:?}");
        }
    }
}
